"""The container preflight (issue 54 item 1): `fsdpjob check-image` runs the image's python with the profile's
runtime and compares its fsdpjob build, torch and transformers with the host's; submit runs it once per image.
Real bubblewrap over images built the way the dev cluster's is (orchestrator/devcluster/image.py): one that has
fsdpjob, one that lacks it, one whose torch is an NGC-style pre-release below the floor, one from another
checkout. No Slurm: bubblewrap runs here."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import yaml
from helpers import fsdpjob
from specs import write_config, write_spec

from fsdpjob.orchestrator.core.errors import FsdpjobError
from fsdpjob.orchestrator.core.jobspec.profiles import load_profile, load_profile_file
from fsdpjob.orchestrator.slurm import imagecheck

REPO = Path(__file__).resolve().parents[1]
SITE = Path("opt/venv/lib/python3.11/site-packages")  # the test image's venv (devcluster/image.py)

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="needs Debian's bubblewrap")


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> dict[str, Path]:
    """The test image, and copies of it (hard links; a changed file is unlinked first, never written through)."""
    from fsdpjob.orchestrator.devcluster import image

    folder = tmp_path_factory.mktemp("images")
    try:
        good = image.build(folder / "good")
    except FsdpjobError as exc:  # no cached base and no mirror to build one
        pytest.skip(f"cannot build the test image: {exc}")

    def variant(name: str) -> Path:
        root = folder / name
        shutil.copytree(good, root, symlinks=True, copy_function=os.link)
        return root

    lacking = variant("lacking")
    shutil.rmtree(lacking / SITE / "fsdpjob")
    old_torch = variant("old-torch")
    [meta] = (old_torch / SITE).glob("torch-*.dist-info/METADATA")
    text = meta.read_text()
    version = next(line for line in text.splitlines() if line.startswith("Version: "))
    meta.unlink()
    meta.write_text(text.replace(version, "Version: 2.6.0a0+df5bbc09d1"))  # NGC 24.12's torch
    new_enough = variant("torch-2.8")  # meets the floor, lacks async save's stager (2.9)
    [meta] = (new_enough / SITE).glob("torch-*.dist-info/METADATA")
    meta.unlink()
    meta.write_text(text.replace(version, "Version: 2.8.0a0+5228986c39"))  # NGC 25.06's torch
    other = variant("other-build")
    init = other / SITE / "fsdpjob/orchestrator/__init__.py"
    text = init.read_text()
    init.unlink()
    init.write_text(text + "# an older checkout\n")
    return {"good": good, "lacking": lacking, "old-torch": old_torch, "torch-2.8": new_enough, "other-build": other}


@pytest.fixture
def profile(tmp_path, monkeypatch) -> Path:
    """The dev cluster's container profile, its cache of checks in this test's folder."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    text = (REPO / "cluster_profiles/test-cluster-container.yaml").read_text()
    path = tmp_path / "test-cluster-container.yaml"
    path.write_text(text)
    return path


def test_an_image_with_the_hosts_fsdpjob_passes_and_is_not_run_again(images, profile, tmp_path):
    done = fsdpjob("check-image", str(images["good"]), "--profile", str(profile), timeout_s=300)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == f"image {images['good']} (bubblewrap, /opt/venv/bin/python)"
    rows = {line.split()[0]: line for line in lines[2:-1]}
    assert rows["fsdpjob"].endswith("same") and rows["torch"].endswith("same"), done.stdout
    assert set(rows) == {"fsdpjob", "torch", "transformers", "submitit", "CUDA", "python"}
    assert lines[-1].startswith("OK:")
    [record] = (tmp_path / "cache/fsdpjob/image-checks").glob("*.json")
    assert json.loads(record.read_text())["build"] == imagecheck.host_facts()["build"]
    again = fsdpjob("check-image", str(images["good"]), "--profile", str(profile), timeout_s=120)
    assert again.returncode == 0 and "passed before (cached)" in again.stdout.splitlines()[0]
    # Another image (here: the same files, another folder) is another identity: checked, not taken from the cache.
    assert imagecheck.plan_check(load_profile_file(profile), image=str(images["lacking"])).key \
        != imagecheck.plan_check(load_profile_file(profile), image=str(images["good"])).key


@pytest.mark.parametrize("which, words", [
    ("lacking", "fsdpjob does not import in the image (ModuleNotFoundError: No module named 'fsdpjob'"),
    ("old-torch", "the image's torch 2.6.0a0+df5bbc09d1 is outside the project's torch>=2.7 (a pre-release X.Y.0a0 "
                  "ranks below X.Y); use a base image whose torch meets it"),
    ("other-build", "but this host runs fsdpjob 0.1.0"),
])
def test_an_image_that_is_not_the_hosts_is_refused_in_one_line_and_not_remembered(images, profile, tmp_path, which,
                                                                                    words):
    done = fsdpjob("check-image", str(images[which]), "--profile", str(profile), timeout_s=300)
    assert done.returncode == 2, (done.stdout, done.stderr)
    [line] = done.stderr.splitlines()
    assert line.startswith(f"{images[which]}: ") and words in line, line
    assert "fsdpjob" in done.stdout  # the table, image beside host
    assert not list((tmp_path / "cache").rglob("*.json"))  # a failing image is checked again next time


def test_submit_refuses_an_image_without_fsdpjob_before_the_queue_and_checks_a_good_one_once(images, profile,
                                                                                          tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text('{"text": "hello"}\n')
    spec = {"name": "img", "profile": str(profile), "resources": {"nodes": 1, "time_limit": "10:00"},
            "model": {"path": str(model_folder(tmp_path / "model"))},
            "data": {"path": str(data), "seq_len": 64}, "train": {"max_steps": 2},
            "container": {"image": str(images["lacking"])}}
    path = write_spec(tmp_path / "job.yaml", spec)
    done = fsdpjob("submit", str(path), cwd=tmp_path, timeout_s=300)
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert "checking the image once" in done.stderr
    assert "fsdpjob does not import in the image" in done.stderr.splitlines()[-1]
    home = Path(os.environ["FSDPJOB_HOME"])
    assert not (home / "registry").exists() and not (home / "runs").exists()
    # --no-image-check goes on to the queue: here the submit then needs a cluster, so only the gate is asked.
    from fsdpjob.orchestrator.slurm.imagecheck import submit_gate

    said: list[str] = []
    good = load_profile_file(profile).container.model_copy(update={"image": str(images["good"])})
    assert submit_gate(good, load_profile_file(profile), echo=said.append) is None
    assert said and said[0].startswith("checking the image once")
    assert submit_gate(good, load_profile_file(profile), echo=said.append) is None and len(said) == 1  # cached


def test_validate_refuses_a_feature_the_checked_images_torch_lacks(images, profile, tmp_path):
    """Issue 54 item 2: once check-image has run an image, its torch is known on this machine, and a feature that
    needs a newer torch than the floor (async save's stager: 2.9) is refused at validate, not at set-up on the
    nodes. Before the check nothing is known, and nothing is refused."""
    data = tmp_path / "train.jsonl"
    data.write_text('{"text": "hello"}\n')
    spec = {"name": "img", "profile": str(profile), "resources": {"nodes": 1, "time_limit": "10:00"},
            "model": {"path": str(model_folder(tmp_path / "model"))}, "data": {"path": str(data), "seq_len": 64},
            "train": {"max_steps": 2}, "checkpoint": {"async_save": True},
            "container": {"image": str(images["torch-2.8"])}}
    path = write_spec(tmp_path / "job.yaml", spec)
    assert fsdpjob("validate", str(path), cwd=tmp_path).returncode == 0
    assert fsdpjob("check-image", str(images["torch-2.8"]), "--profile", str(profile), timeout_s=300).returncode == 0
    done = fsdpjob("validate", str(path), cwd=tmp_path)
    assert done.returncode == 2, done.stdout
    [line] = done.stderr.splitlines()
    assert line.startswith(f"{path}:") and "checkpoint.async_save: needs torch >= 2.9 (DCP's DefaultStager), but the " \
        f"workers' torch is 2.8.0a0+5228986c39 (image {images['torch-2.8']}, as fsdpjob check-image found it): set " \
        "checkpoint.async_save: false" in line, line


def test_the_features_above_the_floor_and_the_torch_they_need():
    from specs import job_spec

    from fsdpjob.orchestrator.core import workertorch

    spec = job_spec({"name": "t", "model": {"path": "/m", "attn_implementation": "varlen"}, "data": {"path": "/d"},
                     "fsdp": {"mixed_precision": "bf16"}, "checkpoint": {"async_save": True},
                     "train": {"max_steps": 5}})
    assert [loc for loc, _ in workertorch.torch_problems(spec, True, "2.8.1+cu128", "x")] == [
        ("checkpoint", "async_save"), ("model", "attn_implementation")]
    assert [loc for loc, _ in workertorch.torch_problems(spec, True, "2.9.0", "x")] == [
        ("model", "attn_implementation")]
    assert workertorch.torch_problems(spec, False, "2.9.0", "x") == []  # varlen on CPU: SDPA per example, any torch
    assert workertorch.torch_problems(spec, True, "2.10.0a0+abc", "x") == []


def test_pyxis_and_apptainer_probes_use_their_launch_words(tmp_path):
    """The runtimes this machine cannot run: the probe's command as the profile's row makes it (one srun task
    in the partition for pyxis; apptainer exec with --nv on GPU nodes), and submit only says how to check."""
    h100 = load_profile("h100")
    check = imagecheck.plan_check(h100, image="nvcr.io#nvidia/pytorch:24.12-py3", python="/usr/bin/python")
    assert list(check.argv[:-1]) == ["srun", "--nodes=1", "--ntasks=1", "--time=15", "--job-name=fsdpjob-check-image",
                                     "--partition=gpu", "--gpus-per-node=8",
                                     "--container-image=nvcr.io#nvidia/pytorch:24.12-py3", "/usr/bin/python", "-c"]
    assert check.argv[-1] == imagecheck.PROBE
    sif = tmp_path / "image.sif"
    sif.write_bytes(b"sif")
    apptainer = load_profile_file(write_profile(tmp_path, "apptainer"))
    assert list(imagecheck.plan_check(apptainer, image=str(sif)).argv[:-1]) == [
        "apptainer", "exec", "--nv", str(sif), "/usr/bin/python3", "-c"]
    # Submit never waits for a queued check: for pyxis it says how to run one.
    note = imagecheck.submit_gate(imagecheck.ContainerSpec(runtime="pyxis", image="nvcr.io#nvidia/pytorch:25.06-py3"),
                                  h100, echo=print)
    assert note is not None and "`fsdpjob check-image --profile h100`" in note


def model_folder(folder: Path) -> Path:
    """A tiny Llama's files as the login node's checks and the planner read them (nothing loads them here)."""
    write_config(folder, {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64,
                          "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                          "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 256})
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_text("{}")
    return folder


def write_profile(folder: Path, runtime: str) -> Path:
    text = yaml.safe_load((REPO / "cluster_profiles/h100.yaml").read_text())
    text.update(container_runtimes=[runtime], container={"runtime": runtime, "python": "/usr/bin/python3"})
    path = folder / f"{runtime}.yaml"
    path.write_text(yaml.safe_dump(text))
    return path


@pytest.mark.parametrize("image, refused", [
    ({"torch": "2.8.0a0+5228986c39", "transformers": "4.57.1", "submitit": "1.5.4"}, None),
    ({"torch": "2.7.0a0+7c8ec84dab", "transformers": "4.57.1", "submitit": "1.5.4"}, "pre-release"),
    ({"torch": "2.9.1", "transformers": "4.40.0", "submitit": "1.5.4"}, "transformers 4.40.0 is outside"),
    ({"torch": "2.9.1", "transformers": "4.57.1", "submitit": "1.6.0"}, "submitit 1.6.0 is outside"),
    ({"torch": None, "transformers": "4.57.1", "submitit": "1.5.4"}, "the image has no torch"),
])
def test_the_floors_are_the_projects_own_requirements(image, refused):
    floors = imagecheck.floors()
    assert floors["torch"] == ">=2.7" and floors["submitit"] == "<1.6,>=1.5.2"
    host = {"build": "B"}
    said = imagecheck.problem({**image, "build": "B"}, host, floors)
    assert (said is None) if refused is None else (refused in said), said
