"""When the memory tier snapshots: every ``interval_steps`` steps, or with "auto" a warm-up snapshot PROBE_STEPS
steps into the launch, a probe snapshot PROBE_STEPS steps later and, PROBE_STEPS steps after it, the interval from
what the probe cost and the job's mean time between faults. The rule itself is core/memtier.auto_interval; this
module measures its inputs and keeps the answer.

The first snapshot of a launch is not measured: it pays once for what later ones reuse (DCP's plan, made with
collectives, and the files' pages, which later snapshots fill again: memory/raw.py, node.keep_spares), so an interval
decided from it would be longer than the snapshots that follow justify (issue 36, R4)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from fsdpjob.orchestrator.core.runfolder.memtier import AUTO, PROBE_STEPS, AutoInterval, auto_interval

log = logging.getLogger("fsdpjob.checkpoint")


class MemorySchedule:
    """The memory tier's snapshot steps; ``due`` is called after every step on every rank (auto measures between
    the calls) and gives every rank the same answer.

    ``slowest`` takes this rank's figures and returns every figure's largest value over the ranks (collective; it
    first finishes the snapshot in flight, whose commit runs collectives on the same group)."""

    def __init__(self, interval_steps: int | str, *, mtbi_s: float | None, rank: int,
                 slowest: Callable[[list[float]], list[float]], clock: Callable[[], float] = time.monotonic) -> None:
        self.auto = interval_steps == AUTO
        self.interval_steps: int | None = None if self.auto else int(interval_steps)
        self.mtbi_s, self.rank, self._slowest, self._clock = mtbi_s, rank, slowest, clock
        self._untold: AutoInterval | None = None  # auto's decision, until the saver takes it for its event
        self._first: int | None = None  # auto: the first step this launch's tier saw
        self._probe: tuple[int, float, float] | None = None  # auto: (the probe's step, its clock, waited_s then)
        self._last_saved: int | None = None

    def saved(self, step: int) -> None:
        """A snapshot of ``step`` was started (the intervals count from it)."""
        self._last_saved = step

    def due(self, step: int, max_steps: int, *, waited_s: float) -> bool:
        """Whether to snapshot after ``step``. ``waited_s``: the loop's time in the tier so far (saves and the
        optimizer's wait for their copies, the one in flight included), which auto's probe measures."""
        if step >= max_steps:
            return False
        if not self.auto:
            return step % self.interval_steps == 0
        if self._first is None:
            self._first = step
        first = self._first
        if self.interval_steps is None:
            warm_up, probe, decide = auto_steps(first)
            if step == probe:  # measured from before the probe's save: the warm-up's costs are all counted already
                self._probe = (step, self._clock(), waited_s)
            if step != decide:
                return step in (warm_up, probe)
            self._decide(step, waited_s)
        # Decided at this step: a snapshot the new interval makes due now is taken now, not a step late.
        return step - (self._last_saved or first) >= self.interval_steps

    def _decide(self, step: int, waited_s: float) -> None:
        """auto: the interval from the probe snapshot's stall (the loop's waits since just before it, the copy's
        wait in the next steps included) and the step time without it; the slowest rank's figures, so that every
        rank computes the same interval."""
        probe, clock, waited = self._probe
        stall = waited_s - waited
        step_s = (self._clock() - clock - stall) / (step - probe)
        # Measured before the slowest's wait for the probe's commit, so the decision does not count that wait.
        stall, step_s = self._slowest([stall, step_s])
        choice = auto_interval(stall, step_s, self.mtbi_s)
        self.interval_steps, self._untold = choice.steps, choice
        if self.rank == 0:
            log.info("%s, from step %d", choice.text(), step)

    def take_auto_choice(self) -> AutoInterval | None:
        """auto's decision, once (the saver reports it as the memory_tier event)."""
        choice, self._untold = self._untold, None
        return choice


def auto_steps(first: int) -> tuple[int, int, int]:
    """auto, for a launch whose tier first sees ``first``: the warm-up snapshot's step (not measured), the probe
    snapshot's and the step that decides the interval from the probe's cost."""
    return first + PROBE_STEPS, first + 2 * PROBE_STEPS, first + 3 * PROBE_STEPS
