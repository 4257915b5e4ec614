"""After a crash or a stall inside the allocation: restart the workers here, or give up (pure).

Giving up hands the attempt to the batch script's failure policy (supervise/failure.py), which requeues or fails
it as before. The rules, in order:
- a cancel, a stop checkpoint (preemption, time limit, external requeue: the workers requeued the job or,
  past preemption.max_requeues, failed it), or a worker error marked not retryable (bad data, a refused
  resume, out of memory) end the loop: a restart cannot help or must not happen;
- a crash before the run ever trained a step ends it: it would crash the same way (a hang may be transient:
  it is restarted, within the budget), unless every rank that said why it failed marked it retryable and one
  failed by itself (a rendezvous port another process took: jobs/train.py), when it is restarted as a hang is;
- ``recovery.max_restarts`` restarts per allocation;
- two restarts in a row that committed no new checkpoint end it: the fault repeats faster than progress;
- a node blamed twice (by the rank that died first or stalled, never by its casualties: blame.py), or lost
  (it no longer runs a probe): the run goes on without it when ``resources.min_nodes`` allows, else the loop
  ends naming the node and the failure policy requeues the job with that node excluded. A blame is
  forgotten once the run trained ``BLAME_FORGOTTEN_AFTER_STEPS`` good steps after it. Where a requeue could
  not exclude a node that still answers (its partition would keep too few others), a requeue would only
  land on the same nodes after Slurm's ~120 s hold: the workers restart here instead (within the budget).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from fsdpjob.orchestrator.core.errors import is_peer_error
from fsdpjob.orchestrator.core.runfolder import attempts, runlog


@dataclass(frozen=True)
class Fault:
    """One crash or stall of one launch (srun step) in this allocation."""

    kind: str  # "crash", "hang" or "straggler"
    launch: int
    committed: int | None  # the newest committed checkpoint step when it happened
    hosts: tuple[str, ...]  # nodes of the blamed ranks
    trained: int = 0  # steps the launch trained before it: what makes earlier blames decay


# A node blamed once and then clean for this many trained steps is not "blamed twice" at its next fault.
BLAME_FORGOTTEN_AFTER_STEPS = 50


@dataclass(frozen=True)
class Decision:
    restart: bool
    why: str
    # Nodes to leave out: of the next launch when restarting (the run goes on with fewer nodes), else of the
    # job's next allocation (the failure policy requeues it with Slurm's exclude list).
    exclude: tuple[str, ...] = ()


def restart_in_allocation(faults: list[Fault], launch_events: list[dict], *, max_restarts: int,
                          ever_trained: bool, can_exclude: bool, dead: tuple[str, ...] = (),
                          excluded: tuple[str, ...] = (), nodes: int = 1, min_nodes: int = 1,
                          requeue_refuses: Callable[[tuple[str, ...]], str | None] | None = None) -> Decision:
    """Restart after ``faults[-1]``? ``launch_events`` are the run-log events written since that launch
    started; ``ever_trained``: a launch of the run trained (core/attempts.ever_trained); ``dead``: nodes that no
    longer run anything (count as blamed twice); ``excluded``: nodes this allocation already left out, of its
    ``nodes``; it may go on with ``min_nodes`` (resources.min_nodes); ``requeue_refuses(nodes)``: why a
    requeue could not keep the job off those nodes (asked only before giving up on them), or None."""
    fault = faults[-1]
    for e in launch_events:
        if e.get("event") == runlog.CANCEL:
            return Decision(False, "the run was cancelled")
        if e.get("event") == runlog.STOP:  # preemption, time limit, an external requeue or a cancel
            return Decision(False, f"the workers left after a {e.get('reason')} stop checkpoint "
                                   f"({'requeued' if e.get('requeued') else 'not requeued: ' + str(e.get('detail'))})")
        if attempts.not_retryable(e):
            return Decision(False, attempts.not_retryable_why(e))
    if fault.kind == "crash" and not ever_trained and not _transient(launch_events):
        return Decision(False,
                        "the workers crashed before the run's first training step; they would crash the same way")
    if len(faults) > max_restarts:
        return Decision(False, f"restart budget spent: {max_restarts} restart(s) in this allocation "
                               "(recovery.max_restarts)")
    if len(faults) >= 3 and faults[-1].committed == faults[-2].committed == faults[-3].committed:
        return Decision(False, f"two restarts in a row committed no new checkpoint (still step {fault.committed})")
    blamed = Counter(host for f in _remembered(faults) for host in set(f.hosts))
    twice = tuple(sorted(({h for h, n in blamed.items() if n >= 2} | set(dead)) - set(excluded)))
    if twice and can_exclude:
        left = nodes - len(excluded) - len(twice)
        if left >= min_nodes:
            how = "lost" if set(twice) <= set(dead) else "blamed twice"
            return Decision(True, f"node(s) {', '.join(twice)} {how}; "
                                  f"going on with {left} node(s) in this allocation (resources.min_nodes {min_nodes}), "
                                  f"from the newest committed checkpoint (restart {len(faults)} of {max_restarts})",
                            exclude=twice)
        refused = requeue_refuses(twice) if requeue_refuses and not set(twice) & set(dead) else None
        if refused:
            return Decision(True, f"node(s) {', '.join(twice)} blamed twice, but a requeue could not exclude them "
                                  f"({refused}): restarting the workers in this allocation instead "
                                  f"(restart {len(faults)} of {max_restarts})")
        return Decision(False, f"node(s) {', '.join(twice)} blamed twice or lost and only {left} of {nodes} would "
                               f"be left (resources.min_nodes {min_nodes}); requeueing the job without them",
                        exclude=twice)
    return Decision(True, f"{fault.kind}: restarting the workers in this allocation from the newest committed "
                          f"checkpoint (restart {len(faults)} of {max_restarts})")


def _transient(launch_events: list[dict]) -> bool:
    """The launch's workers said why they failed, each said a new launch may pass, and one of them failed by
    itself: at the rendezvous, or not after a peer. Peers' lost connections alone are casualties of a rank that
    died without a word (the OOM killer while loading the model: it would die again)."""
    failed = [e for e in launch_events if e.get("event") == runlog.FAILED]
    return (bool(failed) and all(e.get("retryable") is True for e in failed)
            and any(e.get("phase") == "rendezvous" or not is_peer_error(str(e.get("error"))) for e in failed))


def _remembered(faults: list[Fault]) -> list[Fault]:
    """The faults whose blame still counts: those not followed by BLAME_FORGOTTEN_AFTER_STEPS trained steps
    (the launches after a fault trained that much before the next one, or the last, ended)."""
    kept, clean = [], 0
    for fault in reversed(faults):
        if clean < BLAME_FORGOTTEN_AFTER_STEPS:
            kept.append(fault)
        clean += fault.trained
    return kept[::-1]
