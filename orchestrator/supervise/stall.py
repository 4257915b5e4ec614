"""Stall detection over the ranks' heartbeats: pure (beats and clock in, a verdict out), so it is unit-tested
without processes. The supervisor calls ``Watch.observe`` about once a second.

A frozen rank (its heartbeat thread stopped writing: SIGSTOP, a stuck process) is a hang as soon as its
heartbeat is max(``FROZEN_AFTER_S``, floor) old, once the ranks train, whatever phase the others are in: the
others may wait for it in a save or an eval, whose bounds are for ranks that are alive and in that phase.
What counts as progress: any rank's (step, phase) changing. What bounds a wait:
- the launch (srun, a container's start, an image import on nodes that lack it, the interpreter) until every
  rank has reported: ``launch_s`` (the supervisor's: the longest launch this run measured, x3 + 60 s; the first
  start bound where none was measured), never less than the setup bound;
- setup (imports to the first step): ``setup_bound_s`` from the moment every rank had reported;
- a training step: max(factor x the p95 of the recent step times, floor); the first step: the setup bound, or
  factor x the planned step if longer (nothing measured bounds it yet);
- a save or an eval: max(factor x the longest earlier one of that kind, 4 x floor); the first: the setup bound,
  or factor x the planned save if longer.
  A generation round on a vLLM server is also bounded below by ``generation_wait_s`` (the server's request
  deadline and a margin): a rank waits that long on a frozen server before it reports it lost, and the supervisor
  then replaces the server alone (run.py; the wait is excused). A shorter bound would take the frozen server for
  the ranks' hang and restart the whole launch.
  "Earlier" counts what the ranks report in their heartbeats (``Beat.longest``) as well as what the watch saw:
  a save of under a second usually falls between two heartbeats, and without the ranks' own figure a stuck
  second save would wait out the setup bound (minutes) instead of ten times the first.
Who is blamed when the bound passes (the host of a blamed rank may be excluded later):
- a rank whose heartbeat thread stopped (SIGSTOP, a stuck process) -> "hang", that rank;
- ranks behind the others (an earlier step or phase while the others wait in a collective) -> "straggler";
- every rank at the same place (a collective that never completes) -> "hang", no rank singled out.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from fsdpjob.orchestrator.core.runfolder.heartbeat import (
    EXITED,
    GENERATION,
    HEARTBEAT_S,
    LONG_PHASES,
    PHASES,
    SETUP_PHASES,
    Beat,
)

FROZEN_AFTER_S = 3 * HEARTBEAT_S + 2  # a heartbeat older than this: the process is not running
RECENT_STEPS = 50  # step times kept for the p95


@dataclass(frozen=True)
class Verdict:
    kind: str  # "hang" or "straggler"
    ranks: tuple[int, ...]  # blamed ranks (empty: no one rank stands out)
    reason: str  # one line for the run log and status
    waited_s: float  # how long nothing advanced when the verdict was given


@dataclass
class Bounds:
    setup_s: float
    floor_s: float
    factor: float
    # The plan's step and save times (spec.json's worker facts; None: not planned): the first step and the first
    # save or eval, which nothing measured yet bounds, get at least ``factor`` x them, so a long step or save of a
    # large model is never taken for a hang before it was measured.
    planned_step_s: float | None = None
    planned_save_s: float | None = None
    # Ranks that never reported (their process has not started its heartbeat): the launch phase's own bound,
    # measured by the supervisor (None: the setup bound). A container image imported again after a requeue onto
    # new nodes takes minutes before any rank starts; that is not a hang (issue 36 item 3).
    launch_s: float | None = None
    # grpo with a vLLM server: the least a generation round is given (0: no server). See the module docstring.
    generation_wait_s: float = 0.0

    def launch_bound(self) -> float:
        return max(self.setup_s, self.launch_s or 0.0)

    def first(self, planned: float | None, floor: float) -> float:
        return max(self.setup_s, floor, self.factor * (planned or 0.0))


def _p95(values) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))]


def _place(beat: Beat) -> tuple[int, int]:
    return beat.step, PHASES.index(beat.phase) if beat.phase in PHASES else -1


@dataclass
class Watch:
    """Watches one launch (one srun step) of ``world_size`` ranks that started at ``started``."""

    world_size: int
    started: float
    bounds: Bounds
    _places: dict[int, tuple[int, int]] = field(default_factory=dict)
    _last_change: float = 0.0
    _max_step: int = -1
    _step_at: float = 0.0
    _step_times: deque = field(default_factory=lambda: deque(maxlen=RECENT_STEPS))
    _long_phases: dict[str, float] = field(default_factory=dict)  # longest save/eval seen so far
    _in_long: dict[int, tuple[str, float]] = field(default_factory=dict)
    _long_since_step: bool = False
    _stale: set = field(default_factory=set)
    _beat_seen: dict[int, tuple[float, float]] = field(default_factory=dict)  # rank: (its beat's time, seen at)
    training: bool = False  # every rank has reached the loop
    reported_at: float | None = None  # when every rank had reported (the launch phase's end)

    def __post_init__(self) -> None:
        self._last_change = self.started

    def observe(self, beats: list[Beat], now: float) -> Verdict | None:
        self._track(beats, now)
        if not self.training:
            return self._setup_verdict(beats, now)
        ages = self.ages(now)
        after = max(FROZEN_AFTER_S, self.bounds.floor_s)
        frozen = [ages[b.rank] for b in beats if b.phase != EXITED and ages[b.rank] > after]
        if frozen:
            return blame(beats, now, max(frozen), f"a heartbeat stopped {max(frozen):.0f} s ago (bound {after:.0f} s)",
                         ages)
        bound = self.bound()
        waited = now - self._last_change
        if waited < bound:
            return None
        return blame(beats, now, waited, f"no rank advanced for {waited:.0f} s (bound {bound:.0f} s)", ages)

    def excuse(self, now: float) -> None:
        """The ranks waited on something not theirs until ``now`` (a generation server replaced): no progress
        is owed for that time."""
        self._last_change = now

    def ages(self, now: float) -> dict[int, float]:
        """Seconds since each rank's heartbeat last changed, on this clock (a node's clock may be off)."""
        return {rank: now - seen for rank, (_, seen) in self._beat_seen.items()}

    def bound(self) -> float:
        """Seconds without progress that make a stall, for where the live ranks are now."""
        b = self.bounds
        long = {phase for rank, (phase, _) in self._in_long.items() if rank not in self._stale}
        if long:
            server_wait = b.generation_wait_s if GENERATION in long else 0.0
            if not all(p in self._long_phases for p in long):  # a first save or eval: nothing measured yet
                return max(b.first(b.planned_save_s, 4 * b.floor_s), server_wait)
            return max(b.factor * max(self._long_phases[p] for p in long), 4 * b.floor_s, server_wait)
        if not self._step_times:
            return b.first(b.planned_step_s, b.floor_s)  # the first step warms up (allocations, compilation)
        return max(b.factor * _p95(self._step_times), b.floor_s)

    def step_p95(self) -> float | None:
        return _p95(self._step_times) if self._step_times else None

    def _track(self, beats: list[Beat], now: float) -> None:
        for beat in beats:
            if self._beat_seen.get(beat.rank, (None,))[0] != beat.time:
                self._beat_seen[beat.rank] = (beat.time, now)
        # Ranks whose heartbeat is not running: a save or eval they seem to be in is no longer going on.
        self._stale = {rank for rank, age in self.ages(now).items() if age > FROZEN_AFTER_S}
        for beat in beats:
            for phase, took in beat.longest.items():
                if took > self._long_phases.get(phase, -1.0):
                    self._long_phases[phase] = took
            place = _place(beat)
            if self._places.get(beat.rank) != place:
                self._places[beat.rank] = place
                self._last_change = now
            long = self._in_long.get(beat.rank)
            if beat.phase in LONG_PHASES and long is None:
                self._in_long[beat.rank] = (beat.phase, beat.phase_since)
                self._long_since_step = True
            elif long is not None and beat.phase != long[0]:
                del self._in_long[beat.rank]
                took = max(0.0, beat.phase_since - long[1])
                self._long_phases[long[0]] = max(self._long_phases.get(long[0], 0.0), took)
        if len(beats) == self.world_size and self.reported_at is None:
            self.reported_at = now
        if len(beats) == self.world_size and all(b.phase not in SETUP_PHASES for b in beats):
            self.training = True
        if not self.training:
            return
        step = max(b.step for b in beats)
        if step > self._max_step:
            # An interval with a save or an eval in it is not a step time (those have their own bound).
            if self._max_step >= 0 and self._step_at and not self._long_since_step:
                # Per step, however many the heartbeat interval folded into this one observation.
                self._step_times.append((now - self._step_at) / (step - self._max_step))
            self._max_step, self._step_at, self._long_since_step = step, now, False

    def _setup_verdict(self, beats: list[Beat], now: float) -> Verdict | None:
        if self.reported_at is None:  # still in the launch phase
            waited, bound = now - self.started, self.bounds.launch_bound()
            if waited < bound:
                return None
            missing = sorted(set(range(self.world_size)) - {b.rank for b in beats})
            return Verdict("hang", tuple(missing), f"rank(s) {missing} never reported in {waited:.0f} s since the "
                                                   f"launch (bound {bound:.0f} s)", waited)
        waited = now - self.reported_at
        if waited < self.bounds.setup_s:
            return None
        return blame(beats, now, waited, f"setup took over {self.bounds.setup_s:.0f} s", self.ages(now))

    def launch_took(self) -> float | None:
        """Seconds from the launch until every rank had reported (None: not yet)."""
        return None if self.reported_at is None else self.reported_at - self.started


def blame(beats: list[Beat], now: float, waited: float, why: str, ages: dict[int, float] | None = None) -> Verdict:
    """Who stalled the run, from where each rank is and whether its heartbeat still runs (``ages``: seconds
    since each rank's heartbeat changed; by default from the beats' own times)."""
    age = {b.rank: (ages or {}).get(b.rank, now - b.time) for b in beats}
    frozen = [b for b in beats if b.phase != EXITED and age[b.rank] > FROZEN_AFTER_S]
    if frozen:
        where = "; ".join(f"rank {b.rank} on {b.host} frozen in {b.phase!r} at step {b.step} "
                          f"(no heartbeat for {age[b.rank]:.0f} s)" for b in frozen)
        return Verdict("hang", tuple(b.rank for b in frozen), f"{why}: {where}", waited)
    places = {b.rank: _place(b) for b in beats}
    if places and len(set(places.values())) > 1:
        lowest = min(places.values())
        behind = [b for b in beats if places[b.rank] == lowest]
        where = "; ".join(f"rank {b.rank} on {b.host} still in {b.phase!r} at step {b.step}" for b in behind)
        return Verdict("straggler", tuple(b.rank for b in behind), f"{why}: {where} while the others wait", waited)
    at = f" (every rank in {beats[0].phase!r} at step {beats[0].step})" if beats else ""
    return Verdict("hang", (), f"{why}{at}", waited)
