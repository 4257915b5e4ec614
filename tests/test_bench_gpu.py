"""bench/gpu keeps working where it will run once: bench/gpu.py --tiny on CPU (the cases of both device calls), the
wheels --prepare makes for another Python, and --offline's install into an environment that has only what a bare
GPU machine has (torch, transformers, safetensors, click), with no network."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import gpu_wheels  # noqa: E402 - bench/ is no package

HERE_PYTHON = f"{sys.version_info.major}.{sys.version_info.minor}"
OTHER_PYTHON = "3.12" if HERE_PYTHON != "3.12" else "3.11"
# The environment of every bench process: one thread (2 shared cores), and no network: any download fails at once.
NO_NETWORK = {"OMP_NUM_THREADS": "1", "PIP_NO_INDEX": "1", "PIP_CONFIG_FILE": os.devnull, "HF_HUB_OFFLINE": "1",
              **{k: "http://127.0.0.1:9"
                 for k in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY")}}  # fmt: skip


def _records(out: Path, cases: list[str]) -> dict[str, dict]:
    records = {case: json.loads((out / f"{case}.json").read_text()) for case in cases}
    for case in cases:
        assert "error" not in records[case] and records[case]["rate"] > 0, records[case]
        assert records[case]["timed_steps"] >= 10 and records[case]["vmhwm_mb"] > 0
        assert records[case]["mfu_measured"] > 0  # against the probe's matmul (an fp32 one on CPU)
    return records


@pytest.mark.slow
@pytest.mark.distributed
def test_gpu_bench_tiny_group_2_compile_offload_and_save_sync(tmp_path: Path) -> None:
    out = tmp_path / "results"
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "gpu.py"), "--tiny", "--group", "2", "--out", str(out)],
        capture_output=True, text=True, timeout=900, cwd=tmp_path, env=dict(os.environ, **NO_NETWORK),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    records = _records(out, ["fsdpjob-compile", "offload", "save-sync"])
    compiled = records["fsdpjob-compile"]["dynamo"]
    # One graph serves every block (tests/worker/test_model.py): a per-block guard would show as recompiles.
    assert compiled["graphs"] >= 1 and compiled["recompiles"] == 0 and compiled["recompile_limit_hits"] == 0
    assert records["save-sync"]["load_s"] > 0  # the resume from its mid-run checkpoint, timed by the worker
    plan = records["save-sync"]
    assert plan["planned_peak_mb"] > plan["planned_runtime_mb"] > 0 and plan["planned_host_mb"] > 0
    summary = json.loads((out / "results-group2.json").read_text())
    assert set(summary["cases"]) == {"fsdpjob-compile", "offload", "save-sync"} and summary["probe"]["device"] == "cpu"
    table = (out / "table-group2.txt").read_text()
    assert "| fsdpjob-compile | " in table and f"| {compiled['graphs']} / 0 / 0 |" in table
    assert not any((tmp_path / "gpu-bench").glob("*")) and table in done.stdout


def _wheel_tags(name: str) -> tuple[str, str]:
    """(python tag, abi tag) of a wheel's file name."""
    parts = name[: -len(".whl")].split("-")
    return parts[-3], parts[-2]


@pytest.mark.slow
def test_prepare_downloads_wheels_for_another_python(tmp_path: Path) -> None:
    wheels = tmp_path / "whl"
    done = subprocess.run([str(ROOT / "bench" / "gpu"), "--prepare", str(wheels), "--python", OTHER_PYTHON],
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    manifest = json.loads((wheels / "manifest.json").read_text())
    assert manifest["python"] == OTHER_PYTHON
    files = sorted(w.name for w in wheels.glob("*.whl"))
    assert files == sorted(w["file"] for w in manifest["wheels"])
    names = {_wheel_name(wheels / f) for f in files}
    assert names == {*gpu_wheels.CARRIED, "fsdpjob"}  # one of each, nothing else (no torch)
    cp = "cp" + OTHER_PYTHON.replace(".", "")
    for f in files:
        py, abi = _wheel_tags(f)
        assert py == cp and abi == cp or abi == "abi3" or (py.startswith("py3") and abi == "none"), f
        assert "x86_64" in f or f.endswith("-any.whl"), f
    pinned = {w["file"].split("-")[0].replace("_", "-").lower(): w["file"].split("-")[1] for w in manifest["wheels"]}
    assert all(pinned[name] == metadata.version(name) for name in gpu_wheels.CARRIED)  # host and device agree
    assert manifest["total_bytes"] < 60 * 2**20 and "jobs/train.py" in manifest["fsdpjob_sources"]


def _wheel_name(wheel: Path) -> str:
    """The distribution name a wheel's METADATA gives, normalised."""
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        name = next(line for line in z.read(meta).decode().splitlines() if line.startswith("Name:"))
    return name.split(":", 1)[1].strip().lower().replace("_", "-")


# What the bare H200 machine lacks (its image's package list): its transformers and typer need
# no pydantic; this machine's typer does, for its command line, which the worker path never imports.
LACKING = {"pydantic", "pydantic-core", "annotated-types", "typing-inspection", "submitit"}


def _closure(roots: tuple[str, ...]) -> set[str]:
    """The installed distributions ``roots`` need, themselves included (extras left out), less LACKING."""
    seen: set[str] = set()
    todo = list(roots)
    while todo:
        name = todo.pop().lower().replace("_", "-")
        if name in seen or name in LACKING:
            continue
        seen.add(name)
        for line in metadata.requires(name) or []:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return seen


def bare_gpu_like_venv(where: Path) -> Path:
    """A fresh virtual environment that has torch, transformers, safetensors and click (and what they need), and
    pip, as a bare GPU machine does: this machine's installed copies linked into one folder named by a .pth."""
    packages = where / "packages"
    packages.mkdir(parents=True)
    for name in _closure(("torch", "transformers", "safetensors", "click", "pip")):
        for top in {Path(f).parts[0] for f in metadata.distribution(name).files or [] if not str(f).startswith("..")}:
            source = Path(metadata.distribution(name).locate_file(top))
            if source.exists() and not (packages / top).exists() and not top.endswith(".pth"):
                (packages / top).symlink_to(source)
    venv = where / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = next((venv / "lib").glob("python*/site-packages"))
    (site / "bare-gpu.pth").write_text(f"{packages}\n")
    return venv / "bin" / "python"


@pytest.mark.slow
@pytest.mark.distributed
def test_offline_installs_the_wheels_without_a_network_and_runs_group_1(tmp_path: Path) -> None:
    wheels = tmp_path / "whl"
    subprocess.run([str(ROOT / "bench" / "gpu"), "--prepare", str(wheels)], check=True, timeout=600)
    python = bare_gpu_like_venv(tmp_path / "bare")
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    env.update(NO_NETWORK, PYTHON=str(python), PATH=f"{python.parent}:{env['PATH']}")
    lacks = subprocess.run([str(python), "-c", "import pydantic"], env=env, capture_output=True)
    assert lacks.returncode != 0  # the machine bench/gpu --offline is for
    out = tmp_path / "results"
    done = subprocess.run([str(ROOT / "bench" / "gpu"), "--offline", str(wheels), "--tiny", "--group", "1",
                           "--out", str(out)],
                          capture_output=True, text=True, timeout=900, cwd=tmp_path, env=env)  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    assert "the worker path imports" in done.stdout
    records = _records(out, ["bare", "fsdpjob", "save-async"])
    assert records["save-async"]["save_s"] is not None  # one save mid-run, timed in the loop
    # What the async save blocked: the call plus the next step's wait at the staging gate (none where the stager
    # copied in the call: a slow disk's synchronous staging).
    gate = records["save-async"]["gate_wait_s"]
    assert records["save-async"]["blocking_s"] == pytest.approx(records["save-async"]["save_s"] + (gate or 0.0))
    assert records["fsdpjob"]["planned_peak_mb"] > 0 and records["fsdpjob"]["startup_s"] > 0
    assert (out / "table-group1.txt").is_file() and (out / "results-group1.json").is_file()


def test_offline_names_what_is_missing_in_one_line(tmp_path: Path) -> None:
    wheels = tmp_path / "whl"
    wheels.mkdir()
    (wheels / "manifest.json").write_text(json.dumps({"python": OTHER_PYTHON, "wheels": [], "fsdpjob_sources": {}}))
    done = subprocess.run([str(ROOT / "bench" / "gpu"), "--offline", str(wheels), "--tiny"], capture_output=True,
                          text=True, timeout=120, env=dict(os.environ, **NO_NETWORK))  # fmt: skip
    assert done.returncode != 0
    assert done.stderr.strip().splitlines()[-1] == (
        f"bench/gpu --offline: {wheels} holds wheels for Python {OTHER_PYTHON}, this is Python {HERE_PYTHON}: "
        f"run bench/gpu --prepare {wheels} --python {HERE_PYTHON}"
    )


def test_the_import_check_names_the_missing_module() -> None:
    line = gpu_wheels._first_missing(("json", "no_such_module_here"), None)
    assert line.startswith("no_such_module_here cannot be imported (ModuleNotFoundError") and "\n" not in line
