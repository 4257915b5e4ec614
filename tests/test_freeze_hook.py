"""The frozen-rank fault hook (jobs/hooks.py, FSDPJOB_FAULT_STOP_STEP) leaves a last heartbeat that says exactly
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
