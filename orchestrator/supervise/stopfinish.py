"""The end of a stop checkpoint on the batch side: its record and the supervisor's exit code, once the
scheduler's end settled it (slurm/stop.py: what the stop was, and the one requeue)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from fsdpjob.orchestrator.core.runfolder import stophandoff
from fsdpjob.orchestrator.core.runfolder.stophandoff import CANCELLED, NOT_REQUEUED, RESTARTED, Settled, StopHandoff


def finish_stop(run_dir: Path, handoff: StopHandoff, settled: Settled) -> int | None:
    """Record the stop; the supervisor's exit code (1 only when the job is not requeued and not cancelled: the
    batch script's failure policy then finds the not-retryable failure and leaves it), or None: the workers start
    again in this allocation (RESTARTED)."""
    # The requeue makes Slurm SIGTERM this batch step: the supervisor's handler only notes it, and KillWait
    # leaves the time for this record.
    stophandoff.record_stop(run_dir, handoff, reason="cancelled" if settled.outcome == CANCELLED else settled.reason,
                            outcome=settled.outcome, detail=settled.detail,
                            handoff_s=round(time.time() - handoff.committed_at, 3))
    print(f"fsdpjob supervisor: {settled.reason} stop at step {handoff.step}: {settled.detail}", file=sys.stderr,
          flush=True)
    if settled.outcome == RESTARTED:
        return None
    return 1 if settled.outcome == NOT_REQUEUED else 0
