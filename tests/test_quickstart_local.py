"""End to end on the local profile: `fsdpjob quickstart` + `fsdpjob submit --wait` (2 gloo processes, FSDP2)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from functools import partial
from pathlib import Path

import helpers
import pytest
from helpers import ONE_THREAD, status_json, wait_for

REPO = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.distributed, pytest.mark.slow]


# Each call may start or wait for the two local workers: one OpenMP thread each, up to 10 minutes.
fsdpjob = partial(helpers.fsdpjob, env=ONE_THREAD, timeout_s=600)


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
    assert report["nodes"] == os.uname().nodename, report  # the machine it ran on, also once it has finished

    logs = fsdpjob("logs", report["run_id"], "--rank", "0", cwd=tmp_path)
    assert logs.returncode == 0 and "step 150/150" in logs.stdout
    listed = json.loads(fsdpjob("list", "--json", cwd=tmp_path).stdout)
    assert [r["phase"] for r in listed] == ["COMPLETED"]
    bad_rank = fsdpjob("logs", report["run_id"], "--rank", "7", cwd=tmp_path)
    assert bad_rank.returncode == 2 and "out of range" in bad_rank.stderr and "Traceback" not in bad_rank.stderr
    check_goodput_report(report["run_id"], tmp_path)
    check_a_resumed_run_measures_its_step("examples/quickstart.yaml", run_dir, tmp_path)


def check_goodput_report(run_id: str, cwd: Path) -> None:
    """`fsdpjob report --json --plot` on the finished run: the parts add up, some of it was training."""
    png = cwd / "goodput.png"
    out = fsdpjob("report", run_id, "--json", "--plot", str(png), cwd=cwd)
    assert out.returncode == 0, out.stderr
    rep = json.loads(out.stdout)
    assert (abs(sum(rep["unit_seconds"].values()) - rep["allocated_unit_s"])
            <= 0.02 * rep["allocated_unit_s"]), rep["unit_seconds"]
    assert rep["productive_unit_s"] > 0 and 0 < rep["goodput"] <= 1 and 0 < rep["ettr"] <= rep["goodput"], rep
    assert rep["unit"] == "CPU rank" and rep["units"] == 2 and rep["interruptions"] == [], rep
    [attempt] = rep["attempts"]
    assert (attempt["start_step"], attempt["reached_step"], attempt["state"]) == (0, 150, "COMPLETED"), attempt
    assert rep["series"]["step"][-1] == 150 and rep["step_s"] > 0 and rep["save_s"] > 0
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and 20_000 < len(data) < 2_000_000, len(data)
    assert int.from_bytes(data[16:20], "big") >= 800 and int.from_bytes(data[20:24], "big") >= 600  # IHDR size
    status = json.loads(fsdpjob("status", run_id, "--json", cwd=cwd).stdout)
    assert status["goodput"]["goodput"] == pytest.approx(rep["goodput"], rel=0.02), (status["goodput"], rep)


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> Path:
    """One `fsdpjob quickstart` folder (model and data) for the tests that only read it: a CLI launch less each."""
    root = tmp_path_factory.mktemp("quickstart")
    made = fsdpjob("quickstart", str(root / "assets"), cwd=root)
    assert made.returncode == 0, made.stderr
    return root / "assets"


def _run_pids(run_dir: Path) -> list[int]:
    """The local supervisor, controller and worker processes (their command lines name the run's submitit folder)."""
    out = subprocess.run(["pgrep", "-f", f"{run_dir}/submitit"], capture_output=True, text=True).stdout
    return sorted(int(p) for p in out.split())


def test_local_run_survives_a_hangup_and_cancel_stops_it(tmp_path: Path, assets: Path) -> None:
    import signal

    spec = tmp_path / "long.yaml"
    spec.write_text((REPO / "examples" / "quickstart.yaml").read_text())
    # Submitted the way a script's background job would be: SIGINT ignored (inherited over exec; cancel uses SIGTERM).
    sub = fsdpjob("submit", str(spec), "--json", "--set", "train.max_steps=100000",
                  "--set", f"model.path={assets / 'model'}",
                  "--set", f"data.path={assets / 'data.jsonl'}",
                  cwd=tmp_path, timeout_s=120, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    assert sub.returncode == 0, sub.stdout + sub.stderr  # returns at once: no --wait
    run = json.loads(sub.stdout[: sub.stdout.index("}") + 1])
    run_dir = Path(run["run_dir"])

    def step() -> int:
        return status_json(run["run_id"], cwd=tmp_path)["step"] or 0

    wait_for(lambda: step() >= 2, 180, interval_s=0.5, what="step 2")
    pids = _run_pids(run_dir)
    assert len(pids) == 4, pids  # supervisor + submitit controller + 2 ranks
    for pid in pids:  # what a closed terminal sends to the processes it started
        os.kill(pid, signal.SIGHUP)
    reached = step()
    wait_for(lambda: step() >= reached + 3, 120, interval_s=0.5, what="training to go on after SIGHUP")
    assert _run_pids(run_dir) == pids

    cancelled = fsdpjob("cancel", run["run_id"], cwd=tmp_path)
    assert cancelled.returncode == 0, cancelled.stderr
    assert not _run_pids(run_dir)  # cancel returns once the run's processes are gone
    check_a_cancel_is_a_cancel(run, run_dir, cancelled.stdout, tmp_path)


def check_a_resumed_run_measures_its_step(spec: str, source: Path, cwd: Path) -> None:
    """`submit --resume-from` the finished run for 4 more steps (one logged line): its report measures a step time
    ("measured: step -" before), and status names the machine it ran on once it has finished."""
    step = int((source / "checkpoints" / "latest").read_text().strip().removeprefix("step-"))
    done = fsdpjob("submit", spec, "--wait", "--json", "--resume-from", str(source),
                   "--set", f"train.max_steps={step + 4}", cwd=cwd)
    assert done.returncode == 0, done.stdout + done.stderr
    run_id = json.loads(done.stdout[: done.stdout.index("}") + 1])["run_id"]
    rep = json.loads(fsdpjob("report", run_id, "--json", cwd=cwd).stdout)
    [attempt] = rep["attempts"]
    assert (attempt["start_step"], attempt["reached_step"]) == (step, step + 4), attempt
    assert rep["step_s"] is not None and rep["step_s"] > 0, rep
    text = fsdpjob("report", run_id, cwd=cwd).stdout
    assert re.search(r"measured: step [0-9.]+ m?s,", text), text
    status = json.loads(fsdpjob("status", run_id, "--json", cwd=cwd).stdout)
    assert (status["phase"], status["nodes"]) == ("COMPLETED", os.uname().nodename), status


def test_ctrl_c_under_wait_cancels_a_local_run_as_fsdpjob_cancel_does(tmp_path: Path, assets: Path) -> None:
    """Ctrl-C in the terminal of `submit --wait`: SIGINT to the terminal's process group. The run's own session
    keeps it from the workers (no KeyboardInterrupt crash); the CLI cancels the run (a stop checkpoint, a
    cancelled stop) and exits 130."""
    import signal
    import sys

    spec = tmp_path / "long.yaml"
    spec.write_text((REPO / "examples" / "quickstart.yaml").read_text())
    waiting = subprocess.Popen(
        [sys.executable, "-m", "fsdpjob.orchestrator.cli", "submit", str(spec), "--wait", "--json",
         "--set", "train.max_steps=100000", "--set", f"model.path={assets / 'model'}",
         "--set", f"data.path={assets / 'data.jsonl'}"],
        cwd=tmp_path, env={**os.environ, **ONE_THREAD}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,  # the "terminal": its process group gets the SIGINT
        # As a terminal's foreground job has it, whatever started this suite: a background shell (`... &`) hands
        # its children SIGINT ignored, and Python then installs no KeyboardInterrupt handler.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    run = None
    try:
        lines = [waiting.stdout.readline()]  # the --json object, printed at submit
        while lines[-1] and lines[-1].rstrip() != "}":
            lines.append(waiting.stdout.readline())
        run = json.loads("".join(lines))
        run_dir = Path(run["run_dir"])
        wait_for(lambda: status_json(run["run_id"], cwd=tmp_path)["step"] or 0,
                 180, interval_s=0.5, what="a trained step")
        os.killpg(waiting.pid, signal.SIGINT)
        out, err = waiting.communicate(timeout=120)
    finally:
        if waiting.poll() is None:
            waiting.kill()
            if run is not None:  # the run has its own session: it would train on after the test
                fsdpjob("cancel", run["run_id"], cwd=tmp_path)
    assert waiting.returncode == 130 and "Traceback" not in err, err
    assert not _run_pids(run_dir)
    said = next(line for line in err.splitlines() if line.startswith(f"cancelling {run['run_id']}: "))
    check_a_cancel_is_a_cancel(run, run_dir, said, tmp_path)


def check_a_cancel_is_a_cancel(run: dict, run_dir: Path, said: str, cwd: Path) -> None:
    """A local cancel is recorded as Slurm's is: SIGTERM, a stop checkpoint, a stop event with reason cancelled;
    no failure in status, no crash in the report or its picture, no interval advice from it."""
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    [stop] = [e for e in events if e["event"] == "stop"]
    assert (stop["reason"], stop["requeued"]) == ("cancelled", False), stop
    assert said.rstrip().endswith(f": stopped by SIGTERM, stop checkpoint at step {stop['step']}"), said
    assert (run_dir / "checkpoints" / f"step-{stop['step']:08d}" / "COMMITTED").exists()
    assert not [e for e in events if e["event"] in ("failed", "fault")], events[-4:]
    report = json.loads(fsdpjob("status", run["run_id"], "--json", cwd=cwd).stdout)
    assert (report["phase"], report["failure_reason"], report["last_checkpoint_step"]) == (
        "CANCELLED", None, stop["step"]), report
    assert report["last_stop"] == {"reason": "cancelled", "step": stop["step"], "requeued": False}
    text = fsdpjob("status", run["run_id"], cwd=cwd).stdout
    assert f"last stop: cancelled at step {stop['step']}" in text and "failure" not in text, text
    rep = json.loads(fsdpjob("report", run["run_id"], "--json", cwd=cwd).stdout)
    [cut] = rep["interruptions"]  # what the picture marks: a cancel's grey cross, no red crash
    assert (cut["kind"], cut["lost_steps"], cut["recovered"]) == ("cancel", 0, "the run ended here, as cancelled")
    assert rep["advice"] is None and rep["phase"] == "CANCELLED", rep["advice_note"]
    text = fsdpjob("report", run["run_id"], cwd=cwd).stdout
    assert "crash" not in text and "not recovered" not in text and "Young/Daly" not in text, text
