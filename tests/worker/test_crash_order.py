"""A crashing rank aborts its process group before anything that can wait (issue 54, also found): the checkpoint
tiers' close (a writer with a shard in flight) and the trackers' close (W&B's finish) came first, so the rank
lingered while srun's --kill-on-bad-exit waited for it to leave. A clean end keeps the old order: the tiers wait
for their last save, then the group goes."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from fsdpjob.jobs import train


class _Tiers:
    def __init__(self, calls: list[str]):
        self.calls = calls

    def close(self, *, completed: bool, crashed: bool) -> None:
        self.calls.append(f"tiers.close(crashed={crashed})")
        time.sleep(0.2)  # a writer with a shard in flight


def _launch(calls: list[str]):
    report = SimpleNamespace(event=lambda *a, **k: calls.append("report.event"),
                             close=lambda: calls.append("report.close"))
    return SimpleNamespace(report=report, tiers=_Tiers(calls), env=SimpleNamespace(rank=0), state=None,
                           spec=SimpleNamespace(train=SimpleNamespace(method="sft")))


@pytest.mark.parametrize("crash", [True, False])
def test_a_crash_aborts_the_process_group_before_the_tiers_and_trackers_close(monkeypatch, crash):
    calls: list[str] = []
    launch = _launch(calls)
    monkeypatch.setattr(train, "_launch", lambda run_dir, stop: launch)
    monkeypatch.setattr(train, "close_distributed", lambda abort=False: calls.append(f"close_distributed({abort})"))
    monkeypatch.setattr(train.gcpolicy, "stop", lambda: None)

    def set_up(launch):
        if crash:
            raise RuntimeError("connection reset by peer")
        return SimpleNamespace()

    monkeypatch.setattr(train, "_set_up", set_up)
    monkeypatch.setattr(train, "_train", lambda launch, training: None)
    monkeypatch.setattr(train, "_finish", lambda launch, training: {"status": "completed"})
    if crash:
        with pytest.raises(RuntimeError):
            train.run("/nonexistent")
        assert calls == ["report.event", "close_distributed(True)", "tiers.close(crashed=True)", "report.close"]
    else:
        assert train.run("/nonexistent") == {"status": "completed"}
        assert calls == ["tiers.close(crashed=False)", "report.close", "close_distributed(False)"]


_CRASHING_WORKER = """
import concurrent.futures, sys, threading, time
from pathlib import Path
marker = Path(sys.argv[1])
started = threading.Event()

def write():  # a slow writer with a shard in flight (DCP's async writer is a ThreadPoolExecutor's thread)
    started.set()
    time.sleep(float(sys.argv[3]))
    marker.write_text("written")

concurrent.futures.ThreadPoolExecutor(1).submit(write)
started.wait()
from fsdpjob.jobs.entry import TrainJob
if sys.argv[4] == "entry":
    TrainJob(sys.argv[2])()  # a run folder without its files: run() fails at once, a crash like any other
raise RuntimeError("crashed outside the worker's entry")
"""


@pytest.mark.parametrize("through, sleep_s, joined", [("entry", 600, False), ("plain", 3, True)])
def test_a_crashing_worker_exits_without_joining_its_writer_threads(tmp_path, through, sleep_s, joined):
    """Issue 54, also found: after the abort, the worker's exit skips the interpreter's join of non-daemon writer
    threads (a 600 s writer here: the process would outlive the test's bound). Outside the worker's entry the
    ordinary exit stays: the writer is joined and finishes its file."""
    import subprocess
    import sys

    marker = tmp_path / "written"
    done = subprocess.run([sys.executable, "-c", _CRASHING_WORKER, str(marker), str(tmp_path / "no-run"),
                           str(sleep_s), through], capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stderr
    assert "Traceback" in done.stderr  # the crash is still reported before the exit
    assert marker.exists() is joined
