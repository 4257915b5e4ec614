"""The batch side of a stop checkpoint: what the stop was, the one requeue, and its record.

The workers committed a stop checkpoint and handed the stop over (core/stophandoff.py); the supervisor, outside
any container, calls ``finish_stop``. Slurm tells the kind of stop only here, through scontrol: PreemptTime is
set only for a preemption, Restarts has grown before the SIGTERM of an external `scontrol requeue`, and a time
limit is what is left (the remaining time is misleading during a grace period: squeue's %L ignores it).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from fsdpjob.orchestrator.core import stophandoff
from fsdpjob.orchestrator.core.attempts import cap_reached
from fsdpjob.orchestrator.core.stophandoff import CANCELLED, NOT_REQUEUED, REQUEUED, StopHandoff

from . import commands as slurm_cli

# States in which someone (scontrol requeue, Slurm itself at the end of a preemption's grace) is already
# requeueing the job: a second requeue fails, and the job comes back all the same.
_BEING_REQUEUED = ("COMPLETING", "PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED")


def classify(info: dict[str, str], restart_count: int) -> str:
    """'preemption', 'requeue' or 'time_limit' from `scontrol show job`; 'signal' when scontrol knew nothing."""
    if not info:
        return "signal"
    if info.get("PreemptTime", "None") not in ("None", "", "Unknown"):
        return "preemption"
    if int(info.get("Restarts", "0") or 0) > restart_count:
        return "requeue"  # an external `scontrol requeue`: Slurm counted the restart before sending SIGTERM
    return "time_limit"


def requeue(job_id: str, *, restart_count: int, max_requeues: int) -> tuple[str, str]:
    """Requeue the job once, unless it was cancelled or the cap is reached: (outcome, detail)."""
    if capped := cap_reached(restart_count, max_requeues):
        return NOT_REQUEUED, capped
    try:
        refused = slurm_cli.requeue_unless_cancelled(job_id)
    except Exception as exc:  # noqa: BLE001 - e.g. the job is being cancelled or requeued right now
        state = _job_state(job_id)
        if state == "CANCELLED":
            return CANCELLED, f"job {job_id} was cancelled while stopping; not requeued"
        if state in _BEING_REQUEUED:
            return REQUEUED, f"job {job_id} is already being requeued ({state})"
        return NOT_REQUEUED, f"scontrol requeue {job_id} failed ({state or 'state unknown'}): {exc}"
    if refused:
        return CANCELLED, refused
    return REQUEUED, f"requeued Slurm job {job_id}"


def finish_stop(run_dir: Path, handoff: StopHandoff, *, job_id: str, restart_count: int, max_requeues: int) -> int:
    """Classify, requeue, record; the supervisor's exit code (1 only when the job is not requeued and not
    cancelled: the batch script's failure policy then finds the not-retryable failure and leaves it)."""
    try:
        info = slurm_cli.scontrol_job(job_id) or {}
    except Exception as exc:  # noqa: BLE001 - the classification is informational; the requeue still matters
        print(f"fsdpjob supervisor: could not ask scontrol about job {job_id}: {exc}", file=sys.stderr, flush=True)
        info = {}
    reason = classify(info, restart_count)
    outcome, detail = requeue(job_id, restart_count=restart_count, max_requeues=max_requeues)
    # The requeue makes Slurm SIGTERM this batch step: the supervisor's handler only notes it, and KillWait
    # leaves the time for this record.
    stophandoff.record_stop(run_dir, handoff, reason="cancelled" if outcome == CANCELLED else reason,
                            outcome=outcome, detail=detail, handoff_s=round(time.time() - handoff.committed_at, 3))
    print(f"fsdpjob supervisor: {reason} stop at step {handoff.step}: {detail}", file=sys.stderr, flush=True)
    return 1 if outcome == NOT_REQUEUED else 0


def _job_state(job_id: str) -> str | None:
    try:
        return slurm_cli.job_state(job_id)
    except Exception:  # noqa: BLE001
        return None
