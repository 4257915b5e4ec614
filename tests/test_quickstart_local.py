"""End to end on the local profile: `fsdpjob quickstart` + `fsdpjob submit --wait` (2 gloo processes, FSDP2)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def fsdpjob(*args: str, cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "fsdpjob.orchestrator.cli", *args],
        cwd=cwd, capture_output=True, text=True, timeout=timeout, env=dict(os.environ, OMP_NUM_THREADS="1"),
    )


def test_quickstart_trains_and_leaves_metrics_and_checkpoint(tmp_path: Path) -> None:
    work = tmp_path / "examples"
    work.mkdir()
    shutil.copy(REPO / "examples" / "quickstart.yaml", work / "quickstart.yaml")
    made = fsdpjob("quickstart", str(work / "quickstart-assets"), cwd=tmp_path)
    assert made.returncode == 0, made.stderr

    run = fsdpjob("submit", "examples/quickstart.yaml", "--wait", "--json", cwd=tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    run_dir = Path(json.loads(run.stdout[: run.stdout.index("}") + 1])["run_dir"])

    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert metrics[-1]["step"] == 150
    assert metrics[-1]["loss"] < 0.5 * metrics[0]["loss"], [m["loss"] for m in metrics]
    assert (run_dir / "checkpoints" / "latest").exists()
    committed = [p for p in (run_dir / "checkpoints").glob("step-*") if (p / "COMMITTED").exists()]
    assert committed, "no committed checkpoint"
    assert "COMPLETED" in run.stderr + run.stdout

    status = fsdpjob("status", "--json", cwd=tmp_path)
    report = json.loads(status.stdout)
    assert report["phase"] == "COMPLETED" and report["step"] == 150 and report["last_checkpoint_step"] == 150

    logs = fsdpjob("logs", report["run_id"], "--rank", "0", cwd=tmp_path)
    assert logs.returncode == 0 and "step 150/150" in logs.stdout
    listed = json.loads(fsdpjob("list", "--json", cwd=tmp_path).stdout)
    assert [r["phase"] for r in listed] == ["COMPLETED"]
    bad_rank = fsdpjob("logs", report["run_id"], "--rank", "7", cwd=tmp_path)
    assert bad_rank.returncode == 1 and "out of range" in bad_rank.stderr and "Traceback" not in bad_rank.stderr


def _run_pids(run_dir: Path) -> list[int]:
    """The local controller and its worker processes (their command lines name the run's submitit folder)."""
    out = subprocess.run(["pgrep", "-f", f"{run_dir}/submitit"], capture_output=True, text=True).stdout
    return sorted(int(p) for p in out.split())


def _wait(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)
    return value


def test_local_run_survives_a_hangup_and_cancel_stops_it(tmp_path: Path) -> None:
    import signal

    from fsdpjob.orchestrator.views.follow import LOCAL_CANCEL_GRACE_S

    made = fsdpjob("quickstart", str(tmp_path / "assets"), cwd=tmp_path)
    assert made.returncode == 0, made.stderr
    spec = tmp_path / "long.yaml"
    spec.write_text((REPO / "examples" / "quickstart.yaml").read_text())
    # Submitted the way a script's background job would be: SIGINT ignored (inherited over exec).
    sub = subprocess.run(
        [sys.executable, "-m", "fsdpjob.orchestrator.cli", "submit", str(spec), "--json",
         "--set", "train.max_steps=100000", "--set", f"model.path={tmp_path / 'assets' / 'model'}",
         "--set", f"data.path={tmp_path / 'assets' / 'data.jsonl'}"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120, env=dict(os.environ, OMP_NUM_THREADS="1"),
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )
    assert sub.returncode == 0, sub.stdout + sub.stderr  # returns at once: no --wait
    run = json.loads(sub.stdout[: sub.stdout.index("}") + 1])
    run_dir = Path(run["run_dir"])

    def step() -> int:
        return json.loads(fsdpjob("status", run["run_id"], "--json", cwd=tmp_path).stdout)["step"] or 0

    _wait(lambda: step() >= 2, 180, "step 2")
    pids = _run_pids(run_dir)
    assert len(pids) == 3, pids  # controller + 2 ranks
    for pid in pids:  # what a closed terminal sends to the processes it started
        os.kill(pid, signal.SIGHUP)
    reached = step()
    _wait(lambda: step() >= reached + 3, 120, "training to go on after SIGHUP")
    assert _run_pids(run_dir) == pids

    started = time.monotonic()
    cancelled = fsdpjob("cancel", run["run_id"], cwd=tmp_path)
    assert cancelled.returncode == 0, cancelled.stderr
    assert not _run_pids(run_dir)  # cancel returns once the run's processes are gone
    assert time.monotonic() - started < LOCAL_CANCEL_GRACE_S  # by SIGINT, not the SIGKILL fallback
    report = json.loads(fsdpjob("status", run["run_id"], "--json", cwd=tmp_path).stdout)
    assert report["phase"] == "CANCELLED", report
