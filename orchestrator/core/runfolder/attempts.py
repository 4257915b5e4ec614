"""The run log cut into launches and attempts, and the facts the restart rules read from them (pure; standard
library only, the worker imports it too).

A *launch* is one start of the workers (one srun step, one ``start`` event). An *attempt* is one allocation
(one Slurm restart count): its first launch and those the in-allocation supervisor restarted in it. Three
policies read these facts: the supervisor's (supervise/policy.restart_in_allocation), the batch script's
(slurm/failure.requeue_after_crash) and the workers' stop path (jobs/preemption.py, the cap); goodput and
progress count with the same cuts.

"Did it train" has one definition, ``trained``: a launch logged a training step past the step it became
ready at. Not "any metric line" (a line of an earlier launch must not count for this one) and not "it got
ready" (a launch that crashed before its first step, e.g. out of memory at step 0, would crash the same way
again). Where a launch *resumed* is another question, answered by its ready event (core/goodput/account.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from . import runlog


def launches(timeline: list[dict]) -> list[list[dict]]:
    """The time-ordered timeline cut before each ``start`` after the first (what comes before the first start
    belongs to the first launch); one launch, maybe empty, when there is no start at all."""
    out: list[list[dict]] = [[]]
    started = False
    for e in timeline:
        if e.get("event") == runlog.START:
            if started:
                out.append([])
            started = True
        out[-1].append(e)
    return out


def later_starts(events: list[dict]) -> list[dict]:
    """The start events of the launches after the first (where ``launches`` cuts)."""
    return [e for e in events if e.get("event") == runlog.START][1:]


def attempts(timeline: list[dict]) -> list[tuple[int, list[dict]]]:
    """(restart number, events) per attempt, from the workers' start events (anything before the first start
    is dropped); the launches the supervisor restarted share their allocation's restart number and count as
    one attempt."""
    out: list[tuple[int, list[dict]]] = []
    for e in timeline:
        if e.get("event") == runlog.START:
            restart = int(e.get("restart", 0) or 0)
            if out and out[-1][0] == restart and int(e.get("launch", 0) or 0) > 0:
                out[-1][1].append(e)
            else:
                out.append((restart, [e]))
        elif out:
            out[-1][1].append(e)
    return out


def trained(events: list[dict]) -> bool:
    """Did this launch (or attempt) train: a metric line past the step of its first ``ready`` event."""
    ready = runlog.first(events, runlog.READY)
    return ready is not None and any(
        e.get("event") == runlog.METRIC and int(e.get("step", 0)) > int(ready.get("step", 0)) for e in events
    )


def ever_trained(timeline: list[dict]) -> bool:
    """Has any launch of the run trained (``trained``)."""
    return any(trained(launch) for launch in launches(timeline))


def requeued_after_stop(event: dict) -> bool:
    """A stop checkpoint after which the workers requeued the job themselves (nothing is left to requeue)."""
    return event.get("event") == runlog.STOP and bool(event.get("requeued"))


def not_retryable(event: dict) -> bool:
    """A failure the worker marked as one that would happen again (bad data, a refused resume, ...)."""
    return event.get("event") == runlog.FAILED and event.get("retryable") is False


def not_retryable_why(event: dict) -> str:
    return f"not retryable: {event.get('error') or event.get('reason')}"


def unhealthy_streak(timeline: list[dict], restarts: int, *, ending_in_failure: bool) -> int:
    """The requeues in a row that would signal a broken job if the attempt with restart count ``restarts`` were
    requeued now: counting back from it, every attempt that made no progress it kept (it trained nothing, or it
    failed before committing a checkpoint of what it trained). An attempt that trained and ended in a stop (a
    preemption, the time limit, maintenance: its stop checkpoint keeps the progress), or failed after committing a
    checkpoint, ends the streak: those are the cluster's doing, and a long run meets many (bench/fault_sim.py: a
    1,024-GPU run needs ~20 in 2.5 weeks)."""
    cut = dict(attempts(timeline))
    streak = 0
    for restart in range(restarts, -1, -1):
        events = cut.get(restart, [])
        failed = ending_in_failure if restart == restarts else not any(e.get("event") == runlog.STOP for e in events)
        committed = any(e.get("event") == runlog.CHECKPOINT for e in events)
        if trained(events) and (not failed or committed):
            break
        streak += 1
    return streak


def cap_reached(streak: int, max_requeues: int) -> str | None:
    """Why the job may not be requeued again (preemption.max_requeues), or None: ``streak`` is unhealthy_streak's
    count (failures or requeues without progress in a row, this one included); max_requeues 0 never requeues. The
    workers' stop path and the batch script's failure policy both ask."""
    if max_requeues == 0:
        return "requeue cap reached: preemption.max_requeues is 0 (never requeue)"
    if streak > max_requeues:
        return (f"requeue cap reached: {streak} requeues in a row without kept training progress > "
                f"preemption.max_requeues ({max_requeues})")
    return None


@dataclass(frozen=True)
class AttemptTimes:
    """One run of a job as the scheduler accounted it (Unix seconds; None: not yet, or not known)."""

    queued_at: float | None  # submitted, or requeued (a restart's queue time starts at its requeue)
    eligible_at: float | None  # could start from then on (after a requeue: the end of the BeginTime hold)
    start: float | None  # allocation start
    end: float | None  # allocation end; None while it runs
    state: str  # how this run ended (REQUEUED, PREEMPTED, TIMEOUT, COMPLETED...) or its state now
