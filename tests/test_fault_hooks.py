"""Fault hooks of the worker (jobs/hooks.py) on real processes.

The frozen-rank fault hook (FSDPJOB_FAULT_STOP_STEP) leaves a last heartbeat that says exactly
where the rank froze, phase and step, so the hang's reason can be asserted in full again (issue 55: the dev-cluster
test had relaxed it to any phase, because the heartbeat thread's 1 s sample could predate the freeze). A real
process freezes itself with SIGSTOP; this test reads its heartbeat file once the kernel reports it stopped."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

CHILD = """import sys
from fsdpjob.orchestrator.core.runfolder import heartbeat
from fsdpjob.jobs.hooks import TestHooks
heartbeat.start(sys.argv[1], rank=3, launch=0)
heartbeat.at_step(9, heartbeat.NEXT_BATCH)  # as the loop does at the start of step 10
heartbeat.enter(heartbeat.STEP)
TestHooks(stop_step=10, stop_rank=3).maybe_freeze(10, 3)  # at once: the thread's next beat is up to 1 s away
"""


def test_a_rank_that_freezes_itself_leaves_its_exact_phase_and_step(tmp_path: Path) -> None:
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path)])
    try:
        _, status = os.waitpid(child.pid, os.WUNTRACED)
        assert os.WIFSTOPPED(status) and os.WSTOPSIG(status) == signal.SIGSTOP, status
        beat = json.loads((tmp_path / "heartbeat" / "rank-3.json").read_text())
        assert (beat["phase"], beat["step"]) == ("training step", 9), beat
    finally:
        child.kill()
        child.wait()


LOAD_EXIT = """import sys
from fsdpjob.jobs.checkpoint.tiers import ResumeSource
from fsdpjob.jobs.hooks import TestHooks
loads = []
source = ResumeSource("durable", 5, lambda state: loads.append(state) or {"step": 5}, "step-5")
hooks = TestHooks(load_exit_launch=1, load_exit_rank=1)
assert hooks.in_resume(source, launch=0, rank=1) is source and hooks.in_resume(source, launch=1, rank=0) is source
assert hooks.in_resume(None, launch=1, rank=1) is None
wrapped = hooks.in_resume(source, launch=1, rank=1)
wrapped.load({"train": 1})  # the counters: loaded
print("first load done", len(loads), flush=True)
wrapped.load({"model": 2})  # the whole state: the rank leaves here
print("not reached", flush=True)
"""


def test_the_load_exit_hook_leaves_between_the_resumes_two_loads_of_its_launch_and_rank_only() -> None:
    """FSDPJOB_FAULT_LOAD_EXIT_LAUNCH: a second fault during recovery, in the named launch's resume (issue 55); the
    end-to-end run is tests/test_recovery_local.py::test_a_second_crash_while_the_restart_loads_is_recovered_too."""
    done = subprocess.run([sys.executable, "-c", LOAD_EXIT], capture_output=True, text=True, timeout=300)
    assert done.returncode == 70, done.stdout + done.stderr
    assert done.stdout.splitlines() == ["first load done 1"], done.stdout
    assert "fault injection: rank 1 exiting (os._exit) in launch 1's checkpoint load" in done.stderr, done.stderr
