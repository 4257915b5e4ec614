"""The workers' stop hand-off: after a stop checkpoint committed on every rank, rank 0 writes what it knows
(the step, the signal, the save's seconds) to the run folder's ``stop.json`` and every rank exits 0. The
supervisor, on the batch side and outside any container, reads it, asks Slurm what the stop was, requeues the
job once (orchestrator/slurm/stop.py) and records the ``stop`` event (orchestrator/supervise/stopfinish.py).
Workers never run a Slurm command.

A local run has no scheduler to ask: its rank 0 records the stop itself (``record_stop``) and submitit's
controller restarts the workers. Both sides record a stop through ``record_stop``.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

from pydantic import BaseModel, ConfigDict, ValidationError

from ..fileio import write_atomic
from . import runlog
from .paths import RunPaths

# How a stop ends (the supervisor's, or a local rank 0's, decision); RESTARTED: the supervisor starts the workers
# again in this allocation (a SIGTERM that was neither a preemption nor a time limit: slurm/stop.py).
REQUEUED, CANCELLED, NOT_REQUEUED, RESTARTED = "requeued", "cancelled", "not_requeued", "restarted"


class Settled(NamedTuple):
    """How the scheduler's end settled a stop (slurm/stop.py): what it was, how it ended (above), and why."""

    reason: str  # preemption, time_limit, requeue, teardown or signal
    outcome: str
    detail: str


class StopHandoff(BaseModel):
    """What the workers know of a stop once its checkpoint committed on every rank."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    launch: int  # the supervisor's launch that stopped: an older file is never taken for a newer stop
    step: int  # the committed stop checkpoint's step
    signal: int
    save_s: float
    signal_to_commit_s: float
    committed_at: float


def write(run_dir: Path, handoff: StopHandoff) -> None:
    write_atomic(RunPaths(run_dir).stop_file, handoff.model_dump_json())


def take(run_dir: Path, launch: int) -> StopHandoff | None:
    """The hand-off of ``launch`` (removed once read), or None: that launch did not stop for a signal."""
    path = RunPaths(run_dir).stop_file
    try:
        handoff = StopHandoff.model_validate_json(path.read_text())
    except (OSError, ValidationError):
        return None
    path.unlink(missing_ok=True)
    return handoff if handoff.launch == launch else None


def record_stop(run_dir: Path, handoff: StopHandoff, *, reason: str, outcome: str, detail: str,
                **fields: object) -> None:
    """The run log's ``stop`` event (and ``failed`` when the job is not requeued): what status and report read."""
    if outcome == RESTARTED:
        fields["restarted"] = True
    runlog.append(run_dir, runlog.STOP, reason=reason, signal=handoff.signal, step=handoff.step,
                  requeued=outcome == REQUEUED, detail=detail, save_s=round(handoff.save_s, 3),
                  signal_to_commit_s=round(handoff.signal_to_commit_s, 3), **fields)
    if outcome == NOT_REQUEUED:
        runlog.append(run_dir, runlog.FAILED, reason=detail, step=handoff.step, retryable=False)
