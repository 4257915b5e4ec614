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

from fsdpjob.orchestrator.core import runlog
from fsdpjob.orchestrator.core.paths import RunPaths
from fsdpjob.orchestrator.core.runmeta import RunMeta
from fsdpjob.orchestrator.slurm import commands as slurm_cli

# A crash during setup is retried only this many times in a row, and only after an earlier attempt trained:
# the setup is known to work then, so a kill during it (lost node, preemption race) is transient.
MAX_SETUP_CRASHES_IN_A_ROW = 2


def _attempts(events: list[dict]) -> list[tuple[int, list[dict]]]:
    """(restart number, events) per attempt (allocation), from the workers' start events; the launches the
    in-allocation supervisor restarted share their allocation's restart number and count as one attempt."""
    out: list[tuple[int, list[dict]]] = []
    for e in events:
        if e.get("event") == runlog.START:
            restart = int(e.get("restart", 0) or 0)
            if out and out[-1][0] == restart and int(e.get("launch", 0) or 0) > 0:
                out[-1][1].append(e)
            else:
                out.append((restart, [e]))
        elif out:
            out[-1][1].append(e)
    return out


def excluded_nodes(attempt: list[dict]) -> list[str]:
    """Nodes the supervisor gave up on in this attempt (blamed twice): the requeued job must avoid them."""
    return sorted({h for e in attempt if e.get("event") == runlog.FAULT for h in e.get("exclude") or ()})


def _progressed(attempt: list[dict]) -> bool:
    ready = next((e for e in attempt if e.get("event") == runlog.READY), None)
    return ready is not None and any(
        e.get("event") == runlog.METRIC and int(e.get("step", 0)) > int(ready.get("step", 0)) for e in attempt
    )


def _current(attempts: list[tuple[int, list[dict]]], restarts: int) -> list[dict] | None:
    """The events of the attempt with Slurm restart count ``restarts`` (the newest such), if it wrote any."""
    return next((ev for r, ev in reversed(attempts) if r == restarts), None)


def decide(events: list[dict], *, restarts: int, max_requeues: int) -> tuple[bool, str]:
    """(requeue?, why) for the attempt with Slurm restart count ``restarts`` that just failed."""
    attempts = _attempts(events)
    current = _current(attempts, restarts)
    if current is not None:
        if any(e.get("event") == runlog.STOP and e.get("requeued") for e in current):
            return False, "the workers already requeued this job after a stop checkpoint"
        bad = [e for e in current if e.get("event") == runlog.FAILED and e.get("retryable") is False]
        if bad:
            return False, f"not retryable: {bad[0].get('error') or bad[0].get('reason')}"
    if current is not None and _progressed(current):
        why = "a crash after training progressed; resuming from the newest committed checkpoint"
    else:
        trained = [r for r, ev in attempts if _progressed(ev) and r < restarts]
        if not trained:
            return False, "the job failed before its first training step; it would fail the same way again"
        if restarts - trained[-1] > MAX_SETUP_CRASHES_IN_A_ROW:
            return False, f"{restarts - trained[-1]} attempts in a row crashed before training; giving up"
        why = "a crash during setup after earlier attempts trained (transient); retrying"
    capped = cap_reached(restarts, max_requeues)
    return (False, capped) if capped else (True, why)


def cap_reached(restarts: int, max_requeues: int) -> str | None:
    """Why the job may not be requeued again (preemption.max_requeues), or None. The workers' stop path
    (jobs/preemption.py) and this policy share it."""
    if restarts >= max_requeues:
        return f"requeue cap reached: {restarts} restarts >= preemption.max_requeues ({max_requeues})"
    return None


def main(argv: list[str] | None = None) -> int:
    # `scontrol requeue` of our own running job makes Slurm SIGTERM this batch script at once: finish the
    # record (and the node exclusion) first; Slurm's KillWait leaves the time. (Only as the script's process.)
    if argv is None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    run_dir, exit_code = (argv or sys.argv[1:])[:2]
    paths = RunPaths(Path(run_dir))
    preemption = RunMeta.read(paths.run_dir).section("preemption")
    restarts = slurm_cli.restart_count()
    job_id = slurm_cli.job_id_from_env() or ""
    timeline = runlog.timeline(paths.run_dir)
    requeue, why = decide(timeline, restarts=restarts, max_requeues=preemption["max_requeues"])
    # The step this attempt reached: what the next resume loses beyond its checkpoint (fsdpjob status).
    current = _current(_attempts(timeline), restarts) or []
    reached = max((e["step"] for e in current if isinstance(e.get("step"), int)), default=None)
    record = {"exit_code": int(exit_code), "detail": why, "step": reached}
    if requeue:
        refused = slurm_cli.requeue_unless_cancelled(job_id)  # a scancel'ed job's workers fail too
        if refused:
            print(f"fsdpjob: workers exited {exit_code}; {refused}", file=sys.stderr)
            return 0
        if exclude := excluded_nodes(current):
            record["exclusion"] = slurm_cli.exclude_nodes(job_id, exclude)  # the supervisor gave up on them
        runlog.append(paths.run_dir, runlog.REQUEUE, reason="failure", **record)
        print(f"fsdpjob: workers failed (exit {exit_code}); requeued job {job_id}: {why}", file=sys.stderr)
        return 0
    runlog.append(paths.run_dir, runlog.FAILED, reason=f"workers failed (exit {exit_code}), not requeued: {why}", **record)
    print(f"fsdpjob: workers failed (exit {exit_code}); not requeued: {why}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
