"""After a crashed attempt (srun failed): requeue or not. Run by the batch script; pure decision + one side effect.

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

import signal
import sys
from pathlib import Path

from fsdpjob.orchestrator import notify
from fsdpjob.orchestrator.core import attempts, runlog, slurmenv
from fsdpjob.orchestrator.core.paths import RunPaths
from fsdpjob.orchestrator.core.runmeta import RunMeta
from fsdpjob.orchestrator.slurm import commands as slurm_cli

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
    capped = attempts.cap_reached(restarts, max_requeues)
    return (False, capped) if capped else (True, why)


def main(argv: list[str] | None = None) -> int:
    # `scontrol requeue` of our own running job makes Slurm SIGTERM this batch script at once: finish the
    # record (and the node exclusion) first; Slurm's KillWait leaves the time. (Only as the script's process.)
    if argv is None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    run_dir, exit_code = (argv or sys.argv[1:])[:2]
    paths = RunPaths(Path(run_dir))
    preemption = RunMeta.read(paths.run_dir).section("preemption")
    restarts = slurmenv.restart_count()
    job_id = slurmenv.job_id_from_env() or ""
    timeline = runlog.timeline(paths.run_dir)
    requeue, why = requeue_after_crash(timeline, restarts=restarts, max_requeues=preemption["max_requeues"])
    # The step this attempt reached: what the next resume loses beyond its checkpoint (fsdpjob status).
    current = _current(attempts.attempts(timeline), restarts) or []
    reached = max((e["step"] for e in current if isinstance(e.get("step"), int)), default=None)
    record = {"exit_code": int(exit_code), "detail": why, "step": reached}
    if requeue:
        refused = slurm_cli.requeue_unless_cancelled(job_id)  # a scancel'ed job's workers fail too
        if refused:
            print(f"fsdpjob: workers exited {exit_code}; {refused}", file=sys.stderr)
            return 0
        if exclude := excluded_nodes(current):
            record["exclusion"] = slurm_cli.exclude_nodes(job_id, exclude)  # the supervisor gave up on them
        notify.send_now(paths.run_dir, runlog.append(paths.run_dir, runlog.REQUEUE, reason="failure", **record))
        print(f"fsdpjob: workers failed (exit {exit_code}); requeued job {job_id}: {why}", file=sys.stderr)
        return 0
    failed = runlog.append(paths.run_dir, runlog.FAILED, reason=f"workers failed (exit {exit_code}), not requeued: {why}",
                           **record)
    notify.send_now(paths.run_dir, failed)  # after the supervisor ended: it is the batch side's to tell
    print(f"fsdpjob: workers failed (exit {exit_code}); not requeued: {why}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
