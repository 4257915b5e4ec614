"""Who caused a crash (pure): the rank that failed first or died by a signal, not the peers that failed after it.

When one rank dies, its peers fail a moment later in the collective they were in: gloo's "Connection reset
by peer" or "Connection closed by peer", an NCCL remote error, a store or collective timeout. Those ranks are
casualties: blaming their nodes would count a healthy node as faulty (and, blamed twice, exclude it).

What the supervisor has to go on, per rank of the launch:
- on Slurm, the worker's exit as the task's own shell saw it, written before srun learnt of it (core/runfolder/
  taskexit.py): the first rank's is written before the teardown, ranks the teardown kills write none;
- srun's own report, mostly in the order srun learnt it: ``srun: error: n1: task 1: Killed`` comes before the
  lines of the tasks it then tore down (``--kill-on-bad-exit``), on whichever node they ran. Mostly: on a loaded
  machine one node's teardown line (``n1: tasks 0-1: Killed``) was printed before the other node's line of the
  rank that died first (``n2: task 2: Exited with exit code 137``);
- its heartbeat (node, and when its thread last wrote: a dead process stops writing);
- the ``failed`` event the worker writes from its exception handler (error class and message, time). A rank
  killed by a signal (SIGKILL, SIGSEGV, the OOM killer) writes none, which is itself the sign.
The rules:
- a rank whose error is a peer-connection error is a casualty and blames nothing;
- the ranks whose task exit is the earliest written, less casualties, are the cause (the facts below race: they
  decide only where no task wrote its exit, e.g. a node lost with its shells, or a local run). Only exits
  written before the supervisor signalled the step count: after its SIGTERM every worker ends by its own
  handler and its shell records that, in any order. The supervisor leaves the step to srun's
  --kill-on-bad-exit for a while first (supervise/run.py: it saw a process gone, a zombie included, that its
  runtime or shell may not have reaped yet), so this is rare;
- the ranks of srun's first report that are not casualties are the cause, skipping a report that names a
  casualty: those ranks ended together, and one of them was still alive after a peer had failed, so that line
  is the teardown's. Only reports srun printed before the supervisor signalled the step count here: after its
  SIGTERM every rank ends, and a rank that reacted faster than the dead one's container runtime was reported
  first (seen in CI: n1's bubblewrap of the SIGKILLed rank 1 reported after rank 0, which wrote no error);
- else, a rank that wrote no error and whose heartbeat stopped no later than the first error of any rank died
  by a signal before its peers failed: it is the cause (a rank still beating after that was torn down later by
  srun's --kill-on-bad-exit: a casualty);
- else the first rank that failed with any other error is the cause;
- else (every rank killed, a node lost) the ranks without an error whose heartbeat stopped clearly before the
  others' (a node lost with its ranks: the supervisor on another node may see its own ranks torn down first);
- else the ranks the supervisor saw gone itself (by their pid, on its own machine) at the poll that made it end
  the step, less casualties;
- else srun's reports after the signal, by the first rule; else nobody.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from fsdpjob.orchestrator.core.errors import is_peer_error
from fsdpjob.orchestrator.core.runfolder import runlog
from fsdpjob.orchestrator.core.runfolder.heartbeat import EXITED, HEARTBEAT_S, Beat
from fsdpjob.orchestrator.core.runfolder.taskexit import TaskExit

STOPPED_FIRST_S = 2 * HEARTBEAT_S  # a heartbeat this much older than the newest one stopped before the others
SRUN_TASK_EXIT = re.compile(r"srun: error: (?P<node>\S+): tasks? (?P<tasks>[\d,\-]+): (?P<how>.+)")


def srun_task_exit(line: str) -> tuple[tuple[int, ...], str] | None:
    """(ranks, how they ended) from one line of srun's stderr, e.g. ``srun: error: n2: tasks 2-3: Killed``."""
    found = SRUN_TASK_EXIT.search(line)
    if not found:
        return None
    ranks: list[int] = []
    for part in found["tasks"].split(","):
        first, _, last = part.partition("-")
        if first.isdigit() and (not last or last.isdigit()):
            ranks.extend(range(int(first), int(last or first) + 1))
    return tuple(ranks), found["how"].strip()


@dataclass(frozen=True)
class CrashBlame:
    ranks: tuple[int, ...]  # the cause(s); empty: unknown
    hosts: tuple[str, ...]  # their nodes
    casualties: tuple[int, ...]  # ranks that failed because a peer did
    exits: dict[int, str]  # per rank, what the supervisor concluded (for the fault event)


def blame_crash(beats: list[Beat], events: list[dict], gone: tuple[int, ...] = (),
                srun: list[tuple[tuple[int, ...], str]] = (), srun_untouched: int | None = None,
                task_exits: list[TaskExit] = (), signalled_at: float | None = None) -> CrashBlame:
    """``beats``: the launch's last heartbeats; ``events``: the run-log events since the launch started;
    ``gone``: ranks whose process the supervisor saw end (on its own machine) before it signalled the step;
    ``srun``: srun's task exit reports in order (``srun_task_exit``), of which the first ``srun_untouched`` came
    before the supervisor signalled the step (None: it never did); ``task_exits``: the exits the tasks' shells
    wrote (``read_task_exits``), earliest first, of which those written after ``signalled_at`` (when the
    supervisor signalled the step; None: it never did) are the teardown's, not a death's."""
    alive = {b.rank: b for b in beats if b.phase != EXITED}
    failed: dict[int, dict] = {}
    for e in events:
        if e.get("event") == runlog.FAILED and isinstance(e.get("rank"), int) and e["rank"] not in failed:
            failed[e["rank"]] = e
    casualties = tuple(sorted(r for r, e in failed.items() if is_peer_error(str(e.get("error")))))
    exits = {r: f"failed after a peer: {_short(e)}" for r, e in failed.items() if r in casualties}
    untouched = len(srun) if srun_untouched is None else srun_untouched
    task_exits = [e for e in task_exits if signalled_at is None or e.time < signalled_at]
    causes = (_first_exit(task_exits, casualties, alive, failed, exits)
              or _first_in_srun(srun[:untouched], casualties, alive, failed, exits)
              or (_from_errors(alive, failed, casualties, exits) if failed else [])
              or _from_heartbeats(alive, failed, exits)
              or _seen_gone(gone, casualties, alive, failed, exits)
              or _first_in_srun(srun[untouched:], casualties, alive, failed, exits))
    causes = sorted(set(causes))
    hosts = tuple(sorted({alive[r].host for r in causes}))
    return CrashBlame(tuple(causes), hosts, casualties, dict(sorted(exits.items())))


def _first_exit(task_exits, casualties, alive, failed, exits) -> list[int]:
    """The ranks whose worker ended first by its task's own record (a clean exit is no cause), less casualties."""
    own = [e for e in task_exits if e.code != 0 and e.rank not in casualties and e.rank in alive]
    causes = [e for e in own if e.time == own[0].time] if own else []
    for e in causes:
        exits[e.rank] = _with_error(f"ended first ({e.describe()})", e.rank, failed)
    return [e.rank for e in causes]


def _first_in_srun(srun, casualties, alive, failed, exits) -> list[int]:
    """The ranks of srun's first task report that names no casualty (one that does reports the teardown)."""
    for ranks, how in srun:
        if any(r in casualties for r in ranks):
            continue
        causes = [r for r in ranks if r not in casualties and r in alive]
        if causes:
            for rank in causes:
                exits[rank] = _with_error(f"srun reported it first: {how}", rank, failed)
            return causes
    return []


def _seen_gone(gone, casualties, alive, failed, exits) -> list[int]:
    """The ranks whose end made the supervisor end the step, less those that wrote a peer's error."""
    causes = [r for r in gone if r in alive and r not in casualties]
    for rank in causes:
        exits[rank] = _with_error("the supervisor saw its process end first", rank, failed)
    return causes


def _from_errors(alive, failed, casualties, exits) -> list[int]:
    """A rank that wrote nothing and stopped beating before the first error; else the first own error."""
    first_error = min(float(e.get("time", 0)) for e in failed.values())
    causes = []
    for rank, beat in alive.items():
        if rank in failed:
            continue
        if beat.time <= first_error:
            causes.append(rank)
            exits[rank] = "died without an error (a signal: SIGKILL, SIGSEGV, out of memory) before its peers failed"
        else:
            exits[rank] = "ended without an error after its peers failed (the step was torn down)"
    own = sorted((float(e.get("time", 0)), r) for r, e in failed.items() if r not in casualties)
    for _, rank in own:
        exits[rank] = f"failed: {_short(failed[rank])}"
    return causes or [rank for _, rank in own[:1]]


def _from_heartbeats(alive, failed, exits) -> list[int]:
    """The ranks that wrote no error and whose heartbeats stopped clearly before the others'."""
    newest = max((b.time for b in alive.values()), default=0.0)
    causes = [r for r, b in alive.items() if r not in failed and newest - b.time > STOPPED_FIRST_S]
    for rank in alive:
        if rank not in failed:
            exits[rank] = "stopped first, no error written" if rank in causes else "no error written"
    return causes


def _with_error(why: str, rank: int, failed: dict) -> str:
    return why + (f" ({_short(failed[rank])})" if rank in failed else "")


def _short(event: dict) -> str:
    return str(event.get("error") or event.get("reason") or "")[:200]
