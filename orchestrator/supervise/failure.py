"""After a crashed attempt (srun failed): requeue or not. The batch script runs it through its scheduler's end
(slurm/failure.py: Slurm's restart count and job id, and the requeue itself); pure decision + one side effect.

Which exits lead to a requeue:
- a crash of an attempt that trained at least one step (a killed rank, a lost node, a peer's broken
  connection): the job is requeued and resumes from the newest committed checkpoint;
Which never do:
- an attempt that failed before its first step (bad spec or data, missing files, out of memory at step 0,
  a failed rendezvous): running it again would fail the same way;
- a failure the worker itself marked as not retryable (e.g. a data error, a refused resume);
- the requeue cap (preemption.max_requeues) is reached; the run then ends FAILED with that reason.
Preemption and time limits never get here: their workers requeue and exit 0.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Protocol

from fsdpjob.orchestrator.core.runfolder import attempts, runlog
from fsdpjob.orchestrator.core.runfolder.runmeta import RunMeta

from . import notifier

# A crash during setup is retried only this many times in a row, and only after an earlier attempt trained:
# the setup is known to work then, so a kill during it (lost node, preemption race) is transient.
MAX_SETUP_CRASHES_IN_A_ROW = 2


def excluded_nodes(attempt: list[dict]) -> list[str]:
    """Nodes the supervisor gave up on in this attempt (blamed twice): the requeued job must avoid them."""
    return sorted({h for e in attempt if e.get("event") == runlog.FAULT for h in e.get("exclude") or ()})


def _current(cut: list[tuple[int, list[dict]]], restarts: int) -> list[dict] | None:
    """The events of the attempt with Slurm restart count ``restarts`` (the newest such), if it wrote any."""
    return next((ev for r, ev in reversed(cut) if r == restarts), None)


def requeue_after_crash(events: list[dict], *, restarts: int, max_requeues: int) -> tuple[bool, str]:
    """(requeue?, why) for the attempt with Slurm restart count ``restarts`` that just failed."""
    cut = attempts.attempts(events)
    current = _current(cut, restarts)
    if current is not None:
        if any(attempts.requeued_after_stop(e) for e in current):
            return False, "the workers already requeued this job after a stop checkpoint"
        bad = [e for e in current if attempts.not_retryable(e)]
        if bad:
            return False, attempts.not_retryable_why(bad[0])
    if current is not None and attempts.trained(current):
        why = "a crash after training progressed; resuming from the newest committed checkpoint"
    else:
        trained = [r for r, ev in cut if attempts.trained(ev) and r < restarts]
        if not trained:
            return False, "the job failed before its first training step; it would fail the same way again"
        if restarts - trained[-1] > MAX_SETUP_CRASHES_IN_A_ROW:
            return False, f"{restarts - trained[-1]} attempts in a row crashed before training; giving up"
        why = "a crash during setup after earlier attempts trained (transient); retrying"
    capped = attempts.cap_reached(attempts.unhealthy_streak(events, restarts, ending_in_failure=True), max_requeues)
    return (False, capped) if capped else (True, why)


class Requeue(Protocol):
    """The scheduler's end of the policy: the crashed attempt's job, and the two things done to it."""

    job_id: str
    restarts: int  # the scheduler's restart count of this attempt

    def requeue_unless_cancelled(self) -> str | None:
        """Requeue the job; why not, when it was cancelled (its workers fail too)."""

    def exclude_nodes(self, nodes: list[str]) -> str:
        """Keep the requeued job off ``nodes``; what was done, for the record."""


def after_crash(run_dir: Path, exit_code: int, scheduler: Requeue) -> int:
    """Decide, act and record for the attempt that just failed with ``exit_code``; the batch script's exit code
    is the workers' own, so this returns 0 whatever it decided."""
    preemption = RunMeta.read(run_dir).section("preemption")
    timeline = runlog.timeline(run_dir)
    restarts = scheduler.restarts
    requeue, why = requeue_after_crash(timeline, restarts=restarts, max_requeues=preemption["max_requeues"])
    # The step this attempt reached: what the next resume loses beyond its checkpoint (fsdpjob status).
    current = _current(attempts.attempts(timeline), restarts) or []
    reached = max((e["step"] for e in current if isinstance(e.get("step"), int)), default=None)
    record = {"exit_code": exit_code, "detail": why, "step": reached}
    if requeue:
        refused = scheduler.requeue_unless_cancelled()  # a scancel'ed job's workers fail too
        if refused:
            print(f"fsdpjob: workers exited {exit_code}; {refused}", file=sys.stderr)
            return 0
        if exclude := excluded_nodes(current):
            record["exclusion"] = scheduler.exclude_nodes(exclude)  # the supervisor gave up on them
        notifier.send_now(run_dir, runlog.append(run_dir, runlog.REQUEUE, reason="failure", **record))
        print(f"fsdpjob: workers failed (exit {exit_code}); requeued job {scheduler.job_id}: {why}", file=sys.stderr)
        return 0
    failed = runlog.append(run_dir, runlog.FAILED, reason=f"workers failed (exit {exit_code}), not requeued: {why}",
                           **record)
    notifier.send_now(run_dir, failed)  # after the supervisor ended: it is the batch side's to tell
    print(f"fsdpjob: workers failed (exit {exit_code}); not requeued: {why}", file=sys.stderr)
    return 0
