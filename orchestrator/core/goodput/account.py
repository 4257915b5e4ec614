"""Goodput: where every allocated GPU-second of a run went, across all its attempts. One pure function,
``goodput(facts, attempts, events, metrics)``, from the run's facts (its size, when it was submitted), the
scheduler's account of the attempts (sacct rows, or None: the run's own events stand in) and the run log to a
:class:`GoodputReport`. Both sides use it: the login side's views (views/goodput.py passes a registry record's
facts) and the batch side's notifier (supervise/notifier.py passes spec.json's), so it takes no registry record.

Each attempt's allocation is cut into labelled stretches; where two overlap the more specific wins
(checkpoint > hang > lost > productive > launch > start-up > teardown), and what no stretch covers is
``unexplained``, so the parts always add up to the allocated time:

- launch: allocation start (or, after an in-allocation restart, the fault) to the workers' process start
  (the ``start`` event's ``process_started_at``): the batch script, the supervisor, srun, and a container
  runtime's start (image pull or import included);
- start-up: from there to ``ready``: imports, process group, model, data, checkpoint load;
- reference: preference training's reference pass (``reference`` events, start to done or stopped): kept work;
- productive: training of steps that were kept; lost: training of steps a later attempt redid (beyond the
  step it resumed from), and a crash's unfinished step;
- checkpoint: saves that blocked training (``checkpoint`` events' ``save_s``; a stop save from ``stop``);
- hang: from the last progress to a failure that says a collective timed out (no hang detection yet);
- teardown: from the end of the attempt's work (its stop, final save, crash or last event) to the
  allocation's end.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from fsdpjob.orchestrator.core.runfolder import runlog
from fsdpjob.orchestrator.core.runfolder.attempts import AttemptTimes, later_starts
from fsdpjob.orchestrator.core.runfolder.runmeta import RunFacts

from .series import generator_time, series, step_time

CATEGORIES = ("launch", "startup", "reference", "productive", "checkpoint", "lost", "hang", "teardown", "unexplained")
_PRIORITY = ("checkpoint", "hang", "lost", "productive", "launch", "reference", "startup", "teardown")  # overlaps
_SLACK_S = 1.0  # sacct times are whole seconds; an event may carry a time just before its row's Start
_STOP_KINDS = {"cancelled": "cancel"}  # a stop event's reason -> interruption kind (others as they are)
_STATE_KINDS = {"PREEMPTED": "preemption", "TIMEOUT": "time_limit", "NODE_FAIL": "node_fail", "CANCELLED": "cancel",
                "REQUEUED": "requeue", "FAILED": "crash", "OUT_OF_MEMORY": "crash", "BOOT_FAIL": "node_fail"}
_HANG_WORDS = ("timed out", "timeout", "watchdog")  # a failure that says a collective waited too long


@dataclass
class Attempt:
    """One allocation (one sacct row, or one start of the workers when only events tell)."""

    index: int
    state: str
    queued_at: float | None
    eligible_at: float | None
    start: float | None
    end: float | None
    queue_wait_s: float | None  # queued (submit or requeue) -> start, the BeginTime hold included
    held_s: float | None  # queued -> eligible: the hold after a requeue
    allocated_s: float
    start_step: int | None  # where training began (ready), None: never got there
    reached_step: int | None
    seconds: dict[str, float] = field(default_factory=dict)  # wall seconds per category


@dataclass
class Interruption:
    attempt: int
    kind: str  # preemption, time_limit, requeue, cancel, signal, crash, hang, node_fail, unknown
    time: float
    step: int | None  # the step reached
    lost_steps: int
    lost_s: float  # wall seconds of lost work and hang
    recovered: str


@dataclass
class GoodputReport:
    run_id: str
    source: str  # where the attempts' times come from: the backend's account ("sacct", "local") or "events"
    submitted_at: float
    ended_at: float
    wall_s: float
    units: int  # GPUs (nodes x GPUs per node), or CPU ranks
    unit: str  # "GPU" or "CPU rank"
    # Unit-seconds (GPU-seconds, or CPU rank-seconds: wall seconds x units), named so beside the wall seconds.
    allocated_unit_s: float
    unit_seconds: dict[str, float]  # per category (CATEGORIES), summing to allocated_unit_s
    productive_unit_s: float
    goodput: float | None  # productive / allocated
    ettr: float | None  # productive wall time / (end - submit)
    attempts: list[Attempt]
    interruptions: list[Interruption]
    step_s: float | None  # median measured step time
    save_s: float | None  # mean measured blocking save
    series: dict[str, list] = field(default_factory=dict)  # time, step, loss, tokens_per_s (the picture's curves)
    # grpo: productive unit-seconds split into the generator's lines (series.generator_time: generation, weight sync,
    # generator restarts) and training; else None.
    productive_split: dict[str, float] | None = None

    def to_json(self) -> dict:
        return asdict(self)


@dataclass
class _Segment:
    """The events of one start of the workers (an attempt, or part of one after an in-allocation restart)."""

    alloc: Attempt
    begin: float
    end: float
    events: list[dict]
    metrics: list[dict]
    ready: dict | None = None
    reached: int | None = None
    work_end: float | None = None
    kept_until: int | None = None  # the step a later start resumed from (or kept at the end)


def goodput(facts: RunFacts, attempts: list[AttemptTimes] | None, events: list[dict], metrics: list[dict],
            *, now: float | None = None, account: str = "scheduler") -> GoodputReport:
    """The run's goodput report. ``attempts``: the scheduler's account (None: taken from the events), called
    ``account`` in the report's source (the backend's name for it: "sacct", "local"); ``now``: the run still
    runs, so its latest attempt counts up to now."""
    events = sorted((e for e in events if isinstance(e.get("time"), (int, float))), key=lambda e: e["time"])
    metrics = sorted((m for m in metrics if isinstance(m.get("time"), (int, float))), key=lambda m: m["time"])
    allocs = _from_scheduler(attempts, now) if attempts else _from_events(facts, events, metrics, now)
    groups = [_segments(_extended(a, _within(events, a, allocs), _within(metrics, a, allocs)), a) for a in allocs]
    segments = [s for g in groups for s in g]
    for s in segments:
        _analyse(s)
    _assign_kept(segments, live=now is not None)
    for i, (alloc, group) in enumerate(zip(allocs, groups)):
        alloc.index, alloc.seconds = i, dict.fromkeys(CATEGORIES, 0.0)
        for k, v in ((k, v) for s in group for k, v in _label(s).items()):
            alloc.seconds[k] += v
        alloc.seconds["unexplained"] = max(0.0, alloc.allocated_s - sum(alloc.seconds.values()))
        alloc.start_step = group[0].ready.get("step") if group and group[0].ready else None
        alloc.reached_step = max((s.reached for s in group if s.reached is not None), default=None)
    cuts = [_interruption(s, nxt, now is not None) for s, nxt in zip(segments, [*segments[1:], None])]
    report = _report(facts, allocs, [c for c in cuts if c], events, metrics, now, account if attempts else "events")
    generator = generator_time(metrics, events, [(s.begin, s.end, s.kept_until) for s in segments])
    if generator:  # grpo: the trainers' time on the generator, line by line, then their training
        split, left = {}, report.productive_unit_s
        for part, seconds in generator.items():
            split[part] = min(seconds * report.units, left)
            left -= split[part]
        report.productive_split = {**split, "training": left}
    return report


def _from_scheduler(attempts: list[AttemptTimes], now: float | None) -> list[Attempt]:
    # A running attempt counts up to now; a pending one has no allocation yet.
    return [_attempt(a.state, a.queued_at, a.eligible_at, a.start,
                     a.end if a.end is not None or a.start is None else now, now) for a in attempts]


def _from_events(facts: RunFacts, events: list[dict], metrics: list[dict], now: float | None) -> list[Attempt]:
    """Without the scheduler's times: an attempt runs from a start event to its last entry (to now while the
    run goes on); the time before the start event counts as queue wait."""
    starts = [e["time"] for e in events if e.get("event") == runlog.START]
    times = sorted([e["time"] for e in events] + [m["time"] for m in metrics])
    out: list[Attempt] = []
    for i, t0 in enumerate(starts):
        upto = starts[i + 1] if i + 1 < len(starts) else float("inf")
        last = upto == float("inf")
        mine = [t for t in times if t0 <= t < upto]
        end = mine[-1] if mine else t0
        if last and now is not None and not _ended(events, t0):
            end = max(end, now)
        queued = facts.submitted_at if i == 0 else out[-1].end
        state = _state_from_events([e for e in events if t0 <= e["time"] < upto], live=now is not None and last)
        out.append(_attempt(state, queued, None, t0, end, now))
    return out


def _ended(events: list[dict], since: float) -> bool:
    finals = (runlog.DONE, runlog.STOP, runlog.FAILED, runlog.REQUEUE)
    return any(e["time"] >= since and e.get("event") in finals for e in events)


# How an attempt ended, in the scheduler's words, from its events (a stop's reason, a done, a failure).
_STOP_STATES = {"preemption": "PREEMPTED", "time_limit": "TIMEOUT", "requeue": "REQUEUED", "cancelled": "CANCELLED"}


def _state_from_events(events: list[dict], *, live: bool) -> str:
    if _first(events, runlog.DONE):
        return "COMPLETED"
    if stop := _first(events, runlog.STOP):
        return _STOP_STATES.get(stop.get("reason"), "SIGNALLED")
    if _first(events, runlog.FAILED) or _first(events, runlog.REQUEUE):
        return "FAILED"
    return "RUNNING" if live else "UNKNOWN"


def _attempt(state, queued, eligible, start, end, now) -> Attempt:
    waited_until = start if start is not None else now
    return Attempt(
        index=0, state=state, queued_at=queued, eligible_at=eligible, start=start, end=end,
        queue_wait_s=max(0.0, waited_until - queued) if queued is not None and waited_until is not None else None,
        held_s=max(0.0, eligible - queued) if queued is not None and eligible is not None else None,
        allocated_s=max(0.0, end - start) if start is not None and end is not None else 0.0,
        start_step=None, reached_step=None,
    )


def _within(entries: list[dict], alloc: Attempt, allocs: list[Attempt]) -> list[dict]:
    """The entries of an allocation: from its start to the next allocation's start."""
    if alloc.start is None:
        return []
    later = [a.start for a in allocs if a.start is not None and a.start > alloc.start]
    upto = min(later) - _SLACK_S if later else float("inf")
    return [e for e in entries if alloc.start - _SLACK_S <= e["time"] < upto]


def _extended(alloc: Attempt, events: list[dict], metrics: list[dict]) -> tuple[list[dict], list[dict]]:
    """sacct ends a preempted run at the preemption, while its tasks still hold the nodes for their stop save
    (GraceTime, KillWait): the allocation lasts at least until the attempt's last entry."""
    last = max([e["time"] for e in events] + [m["time"] for m in metrics], default=None)
    if alloc.start is not None and alloc.end is not None and last is not None and last > alloc.end:
        alloc.end, alloc.allocated_s = last, last - alloc.start
    return events, metrics


def _segments(entries: tuple[list[dict], list[dict]], alloc: Attempt) -> list[_Segment]:
    """An allocation's events split at each start of the workers (one segment unless they restarted in it)."""
    events, metrics = entries
    if alloc.start is None:
        return []
    end = alloc.end if alloc.end is not None else alloc.start
    bounds = [alloc.start, *[e["time"] for e in later_starts(events)], end]
    last = len(bounds) - 2

    def mine(entries: list[dict], i: int) -> list[dict]:
        # The first segment also takes what came just before the row's start, the last what came after its end.
        lo, hi = (-float("inf") if i == 0 else bounds[i]), (float("inf") if i == last else bounds[i + 1])
        return [e for e in entries if lo <= e["time"] < hi]

    return [_Segment(alloc, bounds[i], max(bounds[i], bounds[i + 1]), mine(events, i), mine(metrics, i))
            for i in range(last + 1)]


def _first(events: list[dict], kind: str, worker: bool = False) -> dict | None:
    # A worker's failure names its rank; the failure policy's names the exit code instead.
    if not worker:
        return runlog.first(events, kind)
    return next((e for e in events if e.get("event") == kind and "rank" in e), None)


def _is_hang(failed: dict | None) -> bool:
    text = str(failed.get("error") or failed.get("reason") or "").lower() if failed else ""
    return any(w in text for w in _HANG_WORDS)


def _progress(s: _Segment) -> list[tuple[float, int]]:
    """(time, step) points where the attempt had finished a step: metrics lines and committed saves."""
    pts = [(m["time"], int(m["step"])) for m in s.metrics if isinstance(m.get("step"), int)]
    pts += [(e["time"], int(e["step"])) for e in s.events
            if e.get("event") == runlog.CHECKPOINT and isinstance(e.get("step"), int)]
    return sorted(pts)


def _analyse(s: _Segment) -> None:
    """Where training began and ended in this segment, and the step it reached."""
    s.ready = _first(s.events, runlog.READY)
    if s.ready is None:
        return
    start_step = int(s.ready.get("step", 0) or 0)
    pts = _progress(s)
    stop, done = _first(s.events, runlog.STOP), _first(s.events, runlog.DONE)
    failed = _first(s.events, runlog.FAILED, True)
    steps = [start_step] + [p[1] for p in pts] + [int(e["step"]) for e in (stop, done, failed)
                                                  if e and isinstance(e.get("step"), int)]
    s.reached = max(steps)
    last_progress = max([s.ready["time"]] + [p[0] for p in pts])
    if stop is not None:
        s.work_end = stop["time"] - float(stop.get("save_s") or 0)
    elif done is not None:
        final = runlog.first(s.events, runlog.CHECKPOINT, reason="final")
        s.work_end = final["time"] - float(final.get("save_s") or 0) if final else done["time"]
    elif failed is not None and not _is_hang(failed):
        s.work_end = failed["time"]  # the unfinished step was work too, lost with the rest
    else:
        s.work_end = last_progress
    s.work_end = max(s.work_end, s.ready["time"])


def _assign_kept(segments: list[_Segment], *, live: bool) -> None:
    """Each segment keeps its steps up to where the next start that got ready resumed; the last keeps all if it
    finished, saved at a stop or still runs, else up to the newest committed checkpoint."""
    # The starts that got ready (not attempts.trained): where a start resumed is its ready step, also when
    # it crashed before its first logged step.
    began = [s for s in segments if s.ready is not None]
    committed = 0
    for i, s in enumerate(began):
        saves = [int(e["step"]) for e in s.events
                 if e.get("event") == runlog.CHECKPOINT and isinstance(e.get("step"), int)]
        committed = max([committed, *saves])
        if i + 1 < len(began):
            s.kept_until = int(began[i + 1].ready.get("step", 0) or 0)
        elif live or _first(s.events, runlog.DONE) or _first(s.events, runlog.STOP):
            s.kept_until = s.reached
        else:
            s.kept_until = min(committed, s.reached or 0)


def _time_of_step(s: _Segment, step: int) -> float:
    """When this segment finished ``step``: its save of that step, else interpolated between progress points."""
    save = runlog.first(s.events, runlog.CHECKPOINT, step=step)
    if save is not None:
        return save["time"]
    pts = [(s.ready["time"], int(s.ready.get("step", 0) or 0)), *_progress(s), (s.work_end, s.reached)]
    for (t0, s0), (t1, s1) in zip(pts, pts[1:]):
        if s0 <= step <= s1:
            return t0 if s1 == s0 else t0 + (t1 - t0) * (step - s0) / (s1 - s0)
    return s.work_end


def _stretches(s: _Segment) -> list[tuple[str, float, float]]:
    """The segment's labelled stretches (label, from, to); they may overlap (see _PRIORITY)."""
    if not s.events and not s.metrics:
        return []  # the allocation ran without a sign from the workers: unexplained
    start = _first(s.events, runlog.START)
    launched = start.get("process_started_at") if start else None
    launch = [("launch", s.begin, float(launched))] if isinstance(launched, (int, float)) else []
    passes = [e["time"] for e in s.events if e.get("event") == runlog.REFERENCE]  # start, then done or stopped
    launch += [("reference", a, b) for a, b in zip(passes[::2], passes[1::2])]
    if s.ready is None:
        last = max([e["time"] for e in s.events] + [m["time"] for m in s.metrics])
        return [*launch, ("startup", s.begin, last), ("teardown", last, s.end)]
    t_ready, start_step = s.ready["time"], int(s.ready.get("step", 0) or 0)
    kept = s.kept_until if s.kept_until is not None else s.reached
    t_kept = s.work_end if kept >= s.reached else t_ready if kept <= start_step else _time_of_step(s, kept)
    out = [("startup", s.begin, t_ready), ("productive", t_ready, t_kept), ("lost", t_kept, s.work_end),
           ("teardown", s.work_end, s.end), *launch]
    stop = _first(s.events, runlog.STOP)
    for e in s.events:
        if e.get("event") == runlog.CHECKPOINT and not (stop is not None and e.get("reason") == "stop"):
            out.append(("checkpoint", e["time"] - float(e.get("save_s") or 0), e["time"]))
    if stop is not None:  # its save_s spans the stop save and the requeue after it
        out.append(("checkpoint", stop["time"] - float(stop.get("save_s") or 0), stop["time"]))
    failed = _first(s.events, runlog.FAILED, True)
    if _is_hang(failed):
        out.append(("hang", s.work_end, failed["time"]))
    return out


def _label(s: _Segment) -> dict[str, float]:
    """Seconds per label within [begin, end]: each piece between two boundaries goes to its first label."""
    spans = [(k, max(a, s.begin), min(b, s.end)) for k, a, b in _stretches(s)]
    spans = [(k, a, b) for k, a, b in spans if b > a]
    cuts = sorted({s.begin, s.end, *(a for _, a, _ in spans), *(b for _, _, b in spans)})
    out = dict.fromkeys(CATEGORIES, 0.0)
    for a, b in zip(cuts, cuts[1:]):
        if a < s.begin or b > s.end:
            continue
        covering = {k for k, x, y in spans if x <= a and b <= y}
        winner = next((k for k in _PRIORITY if k in covering), None)
        if winner is not None:
            out[winner] += b - a
    return out


def _interruption(s: _Segment, nxt: _Segment | None, live: bool) -> Interruption | None:
    if _first(s.events, runlog.DONE) is not None:
        return None
    stop, failed = _first(s.events, runlog.STOP), _first(s.events, runlog.FAILED, True)
    fault = _first(s.events, runlog.FAULT)  # the in-allocation supervisor's verdict, when it acted
    if stop is not None:
        kind = _STOP_KINDS.get(stop.get("reason"), stop.get("reason") or "signal")
    elif fault is not None:
        kind = "crash" if fault.get("kind") == "crash" else "hang"
    elif failed is not None:
        kind = "hang" if _is_hang(failed) else "crash"
    elif _first(s.events, runlog.REQUEUE) is not None or _first(s.events, runlog.FAILED) is not None:
        kind = "crash"  # the failure policy saw the workers fail (before any of them could report it)
    elif _first(s.events, runlog.CANCEL) is not None:
        kind = "cancel"
    elif nxt is None and live:
        return None  # the latest attempt still runs
    else:
        kind = _STATE_KINDS.get(s.alloc.state, "unknown")
    seconds = _label(s)
    lost_steps = max(0, (s.reached or 0) - (s.kept_until if s.kept_until is not None else s.reached or 0))
    return Interruption(
        attempt=s.alloc.index, kind=kind, time=s.work_end or s.end, step=s.reached, lost_steps=lost_steps,
        lost_s=seconds["lost"] + seconds["hang"], recovered=_recovery(s, nxt, live, kind),
    )


def _recovery(s: _Segment, nxt: _Segment | None, live: bool, kind: str) -> str:
    if nxt is None and kind == "cancel":
        return "the run ended here, as cancelled"  # the user's choice: nothing to recover from
    if nxt is None:
        return "waiting to restart" if live else "not recovered: the run ended here"
    if nxt.alloc is s.alloc:
        how = "restarted in the same allocation"
    elif _first(s.events, runlog.REQUEUE) is not None:
        how = "requeued by the failure policy"
    elif (_first(s.events, runlog.STOP) or {}).get("requeued"):
        how = "requeued by the workers"
    else:
        how = "requeued"
    if nxt.ready is None:
        return f"{how}; that start failed in set-up"
    step = int(nxt.ready.get("step", 0) or 0)
    return f"{how}, resumed from step {step}" if step else f"{how}, started over from step 0"


def _report(facts, allocs, interruptions, events, metrics, now, source) -> GoodputReport:
    units, unit = _units(facts)
    starts = [a.start for a in allocs if a.start is not None]
    submitted = facts.submitted_at if facts.submitted_at is not None else min(starts, default=0.0)
    per = {k: sum(a.seconds.get(k, 0.0) for a in allocs) for k in CATEGORIES}
    alloc_wall = sum(a.allocated_s for a in allocs)
    ends = [a.end for a in allocs if a.end is not None] + [e["time"] for e in events[-1:]]
    ended = now if now is not None else max(ends, default=submitted)
    wall = max(0.0, ended - submitted)
    saves = [float(e["save_s"]) for e in events if e.get("event") == runlog.CHECKPOINT and e.get("save_s") is not None]
    return GoodputReport(
        run_id=facts.run_id, source=source, submitted_at=submitted, ended_at=ended, wall_s=wall,
        units=units, unit=unit, allocated_unit_s=alloc_wall * units,
        unit_seconds={k: v * units for k, v in per.items()}, productive_unit_s=per["productive"] * units,
        goodput=per["productive"] / alloc_wall if alloc_wall > 0 else None,
        ettr=per["productive"] / wall if wall > 0 else None,
        attempts=allocs, interruptions=interruptions, step_s=step_time(events, metrics),
        save_s=sum(saves) / len(saves) if saves else None, series=series(metrics),
    )


def _units(facts: RunFacts) -> tuple[int, str]:
    if facts.gpus_per_node:
        return facts.nodes * facts.gpus_per_node, "GPU"
    return facts.world_size, "CPU rank" if facts.gpus_per_node == 0 else "rank"
