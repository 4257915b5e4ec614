"""The container setting (issue 23): mounts, refusals at validate time, the srun line per runtime (the goldens
pyxis-container, apptainer-container and oci-container hold the whole scripts), the oci bundle. The runs in a
real container are in tests/slurm/test_container_slurm.py."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import fsdpjob, run_cli

from fsdpjob.orchestrator.core.jobspec.container import (
    RUNTIME_ROWS,
    ContainerSpec,
    Mount,
    RuntimeRow,
    auto_mounts,
    parse_mount,
    shadowing,
)
from fsdpjob.orchestrator.core.runfolder.paths import RunPaths
from fsdpjob.orchestrator.planner.containers import container_of, input_folders, runtime_problems
from fsdpjob.orchestrator.planner.jobload import load_job
from fsdpjob.orchestrator.slurm.containerline import ContainerLaunch, container_launch, oci_bundle_config
from fsdpjob.orchestrator.slurm.render import build_plan
from fsdpjob.orchestrator.slurm.shellquote import literal, with_vars

VALID = Path(__file__).resolve().parent / "data" / "specs" / "valid"


@pytest.mark.parametrize("text, mount", [
    ("/a", Mount(source="/a", destination="/a")),
    ("/a/:/b//c:ro", Mount(source="/a", destination="/b/c", read_only=True)),
    ("/a:rw", Mount(source="/a", destination="/a")),
])
def test_mounts_parse(text, mount):
    assert parse_mount(text) == mount


@pytest.mark.parametrize("text, words", [
    ("a:/b", "relative"), ("/a:b", "relative"), ("/a:/b:rx", "not SRC"), ("/a,/b", "not SRC"), ("", "not SRC"),
])
def test_bad_mounts_say_why(text, words):
    with pytest.raises(ValueError, match=words):
        parse_mount(text)


def test_automatic_mounts_cover_what_the_workers_touch_once():
    mounts = auto_mounts("/runs/r1", "/ckpt/r1", ["/models/m", "/runs/r1/data", "/data", "/data/sub"])
    # Shorter paths first (a folder before what is mounted inside it); a folder inside a mounted one is left out.
    assert [(m.destination, m.read_only) for m in mounts] == [("/data", True), ("/runs/r1", False),
                                                              ("/ckpt/r1", False), ("/models/m", True)]


def test_the_memory_tiers_folder_outside_dev_is_mounted_written(monkeypatch):
    """Issue 36 item 7 (C6): FSDPJOB_MEMORY_TIER_DIR in the spec's env moves the tier out of /dev/shm, which every
    runtime shares with the host; that folder must be mounted too, or the workers write into the image's tmpfs."""
    from fsdpjob.orchestrator.planner.containers import needed_mounts

    assert auto_mounts("/runs/r1", None, [], "/local/tier")[1] == Mount(source="/local/tier", destination="/local/tier")
    assert auto_mounts("/runs/r1", None, [], "/dev/shm/fsdpjob") == [Mount(source="/runs/r1", destination="/runs/r1")]
    job = load_job(str(VALID / "bubblewrap-container.yaml"), check_files=False,
                   overrides=["checkpoint.memory_interval_steps=5", "env.FSDPJOB_MEMORY_TIER_DIR=/local/tier"])
    assert Mount(source="/local/tier", destination="/local/tier") in needed_mounts(job.spec, "/runs/r1")
    off = load_job(str(VALID / "bubblewrap-container.yaml"), check_files=False,
                   overrides=["env.FSDPJOB_MEMORY_TIER_DIR=/local/tier"])  # no tier: nothing to mount
    assert all(m.destination != "/local/tier" for m in needed_mounts(off.spec, "/runs/r1"))


def test_a_tier_folder_the_profiles_env_moves_is_mounted_made_and_cleaned(tmp_path, monkeypatch):
    """Issue 54, also found: the profile's env exports FSDPJOB_MEMORY_TIER_DIR to the workers as the spec's does;
    the mount, the supervisor's per-node folder and its clean-up read the same folder (the spec's value wins)."""
    from fsdpjob.orchestrator.core.jobspec.spec import JobSpec
    from fsdpjob.orchestrator.core.runfolder.runmeta import RunMeta
    from fsdpjob.orchestrator.supervise.run import Supervisor

    monkeypatch.setattr(sys, "executable", "/opt/venv/bin/python")
    text = (Path(__file__).resolve().parents[1] / "cluster_profiles/test-cluster-container.yaml").read_text()
    profile = tmp_path / "tiered.yaml"
    profile.write_text(text.replace("  FSDPJOB_FAKE_GPUS: \"1\"\n",
                                    "  FSDPJOB_FAKE_GPUS: \"1\"\n  FSDPJOB_MEMORY_TIER_DIR: /local/tier\n"))
    job = load_job(str(VALID / "bubblewrap-container.yaml"), check_files=False, profile=str(profile),
                   overrides=["checkpoint.memory_interval_steps=5"])
    assert Mount(source="/local/tier", destination="/local/tier") in job.container.mounts("/runs/r1")
    plan = build_plan(job, RunPaths(Path("/r")))
    assert "--bind /local/tier /local/tier" in plan.command
    spec_wins = load_job(str(VALID / "bubblewrap-container.yaml"), check_files=False, profile=str(profile),
                         overrides=["checkpoint.memory_interval_steps=5", "env.FSDPJOB_MEMORY_TIER_DIR=/spec/tier"])
    assert {m.destination for m in spec_wins.container.mounts("/runs/r1")} >= {"/spec/tier"}
    assert "/local/tier" not in {m.destination for m in spec_wins.container.mounts("/runs/r1")}
    # The supervisor (which makes the folder on every node and cleans it) reads the profile the run was sent with.
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    spec = JobSpec.model_validate({"name": "sup", "model": {"path": "/m"}, "data": {"path": "/d.jsonl"},
                                   "train": {"max_steps": 5}, "checkpoint": {"memory_interval_steps": 5}})
    RunMeta.of(spec, profile=job.profile.model_dump(mode="json")).write(RunPaths(run_dir))
    assert Supervisor(run_dir, ["true"], world_size=1, scheduler="local").memory_tier == "/local/tier"


def test_the_jobs_variables_win_over_the_images_on_pyxis_and_apptainer(monkeypatch):
    """Issue 36 item 4 (C3): pyxis keeps an image's value for a name unless --container-env names it, and an
    Apptainer image's %environment runs last unless APPTAINERENV_NAME is set: every variable the batch script
    exports for the workers (profile, spec, fsdpjob's) is named, or exported again under the prefix after it."""
    monkeypatch.setattr(sys, "executable", "/opt/venv/bin/python")
    pyxis = build_plan(load_job(str(VALID / "pyxis-container.yaml"), check_files=False), RunPaths(Path("/r")))
    [names] = [w for w in pyxis.srun.split() if w.startswith("--container-env=")]
    exported = {k for k, _ in pyxis.env}
    assert set(names.removeprefix("--container-env=").split(",")) == exported - {"SUBMITIT_EXECUTOR"}
    assert {"OMP_NUM_THREADS", "NCCL_DEBUG", "FSDPJOB_RUN_DIR", "HF_HOME"} <= exported
    apptainer = build_plan(load_job(str(VALID / "apptainer-container.yaml"), check_files=False), RunPaths(Path("/r")))
    names = [k for k, _ in apptainer.env]
    again = [k for k in names if k.startswith("APPTAINERENV_")]
    assert again and names[-len(again):] == again  # after what they copy, so "$NAME" is set under set -u
    assert dict(apptainer.env)["APPTAINERENV_OMP_NUM_THREADS"] == '"$OMP_NUM_THREADS"'
    assert "APPTAINERENV_HF_HUB_OFFLINE" not in names  # the container's own env goes by --env=K=V
    bwrap = build_plan(load_job(str(VALID / "bubblewrap-container.yaml"), check_files=False), RunPaths(Path("/r")))
    assert not any(k.startswith("APPTAINERENV_") for k, _ in bwrap.env)  # no image environment to override


def test_a_requeue_names_its_pyxis_container_afresh_and_a_restart_in_the_attempt_reuses_it(monkeypatch):
    """Issue 36 item 7 (C7): a requeue keeps the job id, so a container the previous attempt left on a node
    (killed mid-import at preemption) would meet the restart under the same name. The name carries the attempt,
    expanded by the batch shell at each start (SLURM_RESTART_COUNT, unset on the first)."""
    monkeypatch.setattr(sys, "executable", "/opt/venv/bin/python")
    plan = build_plan(load_job(str(VALID / "pyxis-container.yaml"), check_files=False), RunPaths(Path("/r")))
    [word] = [w for w in plan.srun.split() if w.startswith("--container-name=")]
    assert word == '--container-name="ngc-pytorch-attempt${SLURM_RESTART_COUNT:-0}"'

    def expanded(restarts: str | None) -> str:
        env = {"PATH": "/usr/bin:/bin"} | ({"SLURM_RESTART_COUNT": restarts} if restarts is not None else {})
        done = subprocess.run(["bash", "-c", f"set -u; printf '%s' {word}"], env=env, capture_output=True,
                              text=True, check=True)
        return done.stdout

    names = [expanded(n) for n in (None, "0", "1", "2")]
    assert names == ["--container-name=ngc-pytorch-attempt0"] * 2 + ["--container-name=ngc-pytorch-attempt1",
                                                                    "--container-name=ngc-pytorch-attempt2"]
    assert all(re.fullmatch(r"--container-name=[A-Za-z0-9][A-Za-z0-9_.-]*", n) for n in names)  # enroot's rule
    # No image: the name is a container already on the nodes, taken as it is.
    launch = container_launch(ContainerSpec(runtime="pyxis", name="mine"), [], run_dir="/r", gpus=True,
                              literal=literal, with_vars=with_vars)
    assert "--container-name=mine" in launch.srun_options


def test_a_mount_that_hides_a_needed_folder_is_found():
    needed = auto_mounts("/runs/r1", None, ["/data"])
    assert shadowing([parse_mount("/elsewhere:/data")], needed) == [(parse_mount("/elsewhere:/data"), needed[0])]
    assert shadowing([parse_mount("/other:/")], needed)  # above everything
    assert not shadowing([parse_mount("/data")], needed)  # the same folder at the same path is fine
    assert not shadowing([parse_mount("/x:/cache")], needed)


def test_the_spec_overrides_the_profile_and_adds_mounts_and_env(monkeypatch):
    monkeypatch.setattr(sys, "executable", "/opt/venv/bin/python")
    job = load_job(str(VALID / "pyxis-container.yaml"), check_files=False,
                   overrides=("container.image=/images/other.sqsh",))
    container = container_of(job.spec, job.profile)
    assert (container.runtime, container.image, container.mounts) == ("pyxis", "/images/other.sqsh",
                                                                     ["/scratch/hf-cache:/cache"])
    assert input_folders(job.spec) == ["/data/models/llama-3-8b", "/data/sets"]
    assert ContainerSpec(mounts=["/a"], env={"A": "1"}).merged(ContainerSpec(mounts=["/b"], env={"B": "2"})) == \
        ContainerSpec(mounts=["/a", "/b"], env={"A": "1", "B": "2"})


def test_the_workers_python_is_the_images_and_the_supervisors_the_hosts(monkeypatch):
    monkeypatch.setattr(sys, "executable", "/opt/venv/bin/python")
    job = load_job(str(VALID / "pyxis-container.yaml"), check_files=False)
    plan = build_plan(job, RunPaths(Path("/runs/x")))
    assert plan.python == "/opt/venv/bin/python" and plan.worker_python == "/usr/bin/python"
    # Every task runs under the task's shell (core/runfolder/taskexit.py), in the container for pyxis.
    command = plan.with_command("/usr/bin/python -u -m submitit.core._submit /runs/x/submitit").command
    assert command.startswith("sh -c ") and command.split(" fsdpjob-task ", 1)[1].startswith("/usr/bin/python")
    apptainer = build_plan(load_job(str(VALID / "apptainer-container.yaml"), check_files=False), RunPaths(Path("/r")))
    command = apptainer.with_command("PY -u -m submitit").command
    assert command.split(" fsdpjob-task ", 1)[1].startswith("apptainer exec --nv --bind ")
    assert apptainer.with_command("PY -u -m submitit").command.endswith(
        "/proj/images/pytorch-24.12.sif PY -u -m submitit")


def test_the_oci_bundle_keeps_the_hosts_network_pid_and_ipc_and_mounts_the_run():
    container = ContainerSpec(runtime="oci", image="/images/b", env={"HOME": "/tmp"}, workdir="/w")
    config = json.loads(oci_bundle_config(container, auto_mounts("/tmp/runs/r", None, ["/models/m"])))
    assert config["linux"]["namespaces"] == [{"type": "mount"}]
    assert config["root"] == {"path": "/images/b/rootfs", "readonly": True}
    dests = [m["destination"] for m in config["mounts"]]
    assert dests.index("/tmp") < dests.index("/tmp/runs/r")  # the tmpfs first, the run folder on top of it
    run = next(m for m in config["mounts"] if m["destination"] == "/tmp/runs/r")
    model = next(m for m in config["mounts"] if m["destination"] == "/models/m")
    assert "rw" in run["options"] and "ro" in model["options"]
    assert config["process"]["env"] == ["HOME=/tmp"] and config["process"]["cwd"] == "/w"


def test_the_bubblewrap_line_mounts_the_image_read_only_and_the_run_on_a_tmpfs(monkeypatch):
    monkeypatch.setattr(sys, "executable", "/opt/venv/bin/python")
    plan = build_plan(load_job(str(VALID / "bubblewrap-container.yaml"), check_files=False), RunPaths(Path("/tmp/r")))
    assert plan.launcher.startswith("sh -c \"trap '' TERM USR2; ")  # the task's shell outlives the stop signal
    words = plan.launcher.split(" fsdpjob-task ", 1)[1].split()
    assert words[:2] == ["bwrap", "--die-with-parent"], words
    assert words[2:5] == ["--ro-bind", "/tmp/fsdpjob-devcluster/images/fsdpjob-test", "/"], words
    assert words.index("--tmpfs") < words.index("/tmp/r") and words[-1] == "--"
    assert "--bind /tmp/r /tmp/r" in plan.launcher
    assert "--ro-bind /tmp/models/tiny /tmp/models/tiny" in plan.launcher


def test_submit_writes_the_oci_bundle_into_the_run_folder(tmp_path, monkeypatch):
    job = load_job(str(VALID / "oci-container.yaml"), check_files=False)
    plan = build_plan(job, RunPaths(tmp_path / "run"))
    [(name, text)] = plan.files
    assert name == "container/config.json" and json.loads(text)["root"]["path"] == "/lustre/images/pytorch-24.12/rootfs"
    assert f"--container={tmp_path / 'run' / 'container'}" in plan.srun


@pytest.mark.parametrize("change, says", [
    ("container.runtime=apptainer", "container.runtime: profile 'h100' lists container_runtimes: [pyxis]"),
    ("container.mounts=[/x:/data/sets]", "container.mounts: mount /x:/data/sets would hide /data/sets"),
    ("container.mounts=[rel:/x]", "container.mounts: mount 'rel:/x': 'rel' is relative"),
    ("container.workdir=cache", "container.workdir: 'cache' is relative"),
    ("container.env={1A: x}", "container.env"),
    ("profile=local", "container: profile 'local' is a local profile: containers run on Slurm only"),
    ("profile=test-cluster", "profile 'test-cluster' lists container_runtimes: [none]"),
    ("container.name='a b'", "container.name: 'a b': a container name is letters, digits"),
])
def test_a_container_that_would_fail_on_the_node_is_refused_at_validate(change, says):
    done = fsdpjob("validate", str(VALID / "pyxis-container.yaml"), "--no-file-checks", "--set", change)
    assert done.returncode == 2 and says in done.stderr, done.stderr
    # FILE:LINE of the field, or the --set that gave it its value
    key = change.split("=")[0]
    where = f"--set {change}: " if says.split(":")[0] == key else str(VALID / "pyxis-container.yaml") + ":"
    assert done.stderr.startswith(where), done.stderr


def test_a_runtime_is_one_row_of_the_table(monkeypatch):
    """A new runtime is a row of core/container.RUNTIME_ROWS: the launch line and the checks read it."""
    row = RuntimeRow(image_kind="a test image", line="launcher", head=("run-in",), binds=("-v", "{binds}"),
                     workdir_words=("-w", "{workdir}"), env_each=("-e", "{key}={value}"), tail=("{image}",))
    monkeypatch.setitem(RUNTIME_ROWS, "test", row)
    container = ContainerSpec.model_construct(runtime="test", image="/i", workdir="/w", env={"A": "1"}, name="x")
    launch = container_launch(container, [Mount(source="/r", destination="/r")], run_dir="/r", gpus=True,
                              literal=str, with_vars=str)
    assert launch == ContainerLaunch((), ("run-in", "-v", "/r:/r", "-w", "/w", "-e", "A=1", "/i"), (), None)
    assert [field for field, _ in runtime_problems(container)] == ["name"]  # takes no name (pyxis does)
    assert [field for field, _ in runtime_problems(container.model_copy(update={"image": None}))] == ["name", "image"]


def test_a_container_name_is_for_pyxis_only():
    done = fsdpjob("validate", str(VALID / "apptainer-container.yaml"), "--no-file-checks", "--set", "container.name=x")
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("--set container.name=x: container.name: a container name is pyxis's"), done.stderr


def test_an_image_is_required_and_an_oci_or_bubblewrap_image_is_a_folder(tmp_path):
    spec = tmp_path / "s.yaml"
    spec.write_text((VALID / "bubblewrap-container.yaml").read_text() + "container:\n  image: rootfs\n")
    done = fsdpjob("validate", str(spec), "--no-file-checks")
    assert done.returncode == 2 and "a root file system folder" in done.stderr, done.stderr
    done = fsdpjob("validate", str(VALID / "oci-container.yaml"), "--no-file-checks", "--set", "container.image=b")
    assert done.returncode == 2 and "an OCI bundle folder" in done.stderr, done.stderr
    named = (VALID / "pyxis-container.yaml").read_text().replace('  image: "nvcr.io#nvidia/pytorch:24.12-py3"\n', "")
    spec.write_text(named.replace("  name: ngc-pytorch\n", ""))
    done = fsdpjob("validate", str(spec), "--no-file-checks", "--set", "profile=h100")
    assert done.returncode == 2 and "a pyxis container needs an image" in done.stderr, done.stderr
    # A named container already on the nodes (enroot's pyxis_NAME) needs no image.
    spec.write_text(named)
    done = fsdpjob("validate", str(spec), "--no-file-checks", "--set", "profile=h100")
    assert done.returncode == 0, done.stderr


def test_a_folder_image_that_is_missing_or_a_file_is_refused_with_the_file_checks(tmp_path):
    """bubblewrap would fail to start every task on the nodes, after the queue."""
    from helpers import tiny_model_folder

    model = tiny_model_folder(tmp_path / "model")
    (tmp_path / "d.jsonl").write_text('{"text": "hi"}\n')
    (tmp_path / "file").write_text("")
    spec = tmp_path / "s.yaml"
    base = (f"name: b\nprofile: test-cluster-container\nmodel:\n  path: {model}\ndata:\n  path: d.jsonl\n"
            "  seq_len: 64\ntrain:\n  max_steps: 10\ncontainer:\n  image: {image}\n")
    for image, what in ((tmp_path / "file", "is a file"), (tmp_path / "nope", "does not exist")):
        spec.write_text(base.format(image=image))
        done = fsdpjob("validate", str(spec))
        assert done.returncode == 2 and len(done.stderr.splitlines()) == 1, done.stderr
        assert done.stderr.startswith(f"{spec}:11: container.image: image {image} {what}; the bubblewrap runtime "
                                      "takes a root file system folder"), done.stderr
        assert fsdpjob("validate", str(spec), "--no-file-checks").returncode == 0
    (tmp_path / "rootfs").mkdir()
    spec.write_text(base.format(image=tmp_path / "rootfs"))
    done = fsdpjob("validate", str(spec))
    assert done.returncode == 0, done.stderr


def test_oci_on_gpu_nodes_and_an_apptainer_registry_image_are_refused_at_validate(tmp_path):
    """Issue 36 items 5 and 6: Slurm's OCI bundle as fsdpjob writes it gives GPU workers no devices; an Apptainer
    docker:// image would be pulled and converted by every task at every start. Each one line, exit 2."""
    spec = VALID / "oci-container.yaml"
    ok = run_cli("validate", str(spec), "--no-file-checks")
    assert ok[0] == 0, ok
    code, _, err = run_cli("validate", str(spec), "--no-file-checks", "--set", "resources.gpus_per_node=2")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "no NVIDIA hook or CDI devices" in err, err
    code, _, err = run_cli("validate", str(VALID / "apptainer-container.yaml"), "--no-file-checks",
                           "--set", "container.image=docker://nvcr.io/nvidia/pytorch:24.12-py3")
    assert code == 2 and "convert it once" in err and "apptainer pull" in err, err


def test_a_vllm_server_in_a_container_run_needs_its_own_python_on_the_nodes(tmp_path):
    """The supervisor starts vLLM as a step of its own outside the workers' container (supervise/genserver.py): its
    default python (the supervisor's, on the host) has no vLLM, so a container run must name one."""
    spec = tmp_path / "grpo.yaml"
    spec.write_text("name: grpo-ct\nprofile: h100\nresources: {nodes: 2}\nmodel: {path: /models/llama}\n"
                    "data: {path: /data/sets/prompts.jsonl, seq_len: 1024}\n"
                    "train: {method: grpo, max_steps: 10, micro_batch_size: 8}\n"
                    "container: {runtime: pyxis, image: 'nvcr.io#nvidia/pytorch:24.12-py3'}\n"
                    "grpo:\n  reward: [rewards.py:digits]\n  generator: {backend: vllm, nodes: 1}\n")
    done = fsdpjob("validate", str(spec), "--no-file-checks")
    assert done.returncode == 2 and done.stderr.startswith(f"{spec}:10: grpo.generator.python: the vLLM server runs "
                                                           "outside the workers' container"), done.stderr
    done = fsdpjob("validate", str(spec), "--no-file-checks", "--set", "grpo.generator.python=/opt/vllm/bin/python")
    assert done.returncode == 0, done.stderr
