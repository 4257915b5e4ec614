"""Checkpoint interval advice: Young/Daly's optimum sqrt(2 x save time x mean time between interruptions)
and the time a periodic-save setting is expected to lose per hour, against that optimum. Pure arithmetic;
`fsdpjob plan` (a profile's expected interruption rate) and `fsdpjob report` (the interruptions a run saw)
both use it.

Only interruptions that come without a warning count: a preemption or time limit whose signal arrives sends
the workers into a stop checkpoint and loses nothing, whatever the interval.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class IntervalAdvice:
    save_s: float  # one blocking save
    mtbi_s: float  # mean time between interruptions that lose work
    optimal_s: float  # Young/Daly: sqrt(2 x save_s x mtbi_s)
    current_s: float  # what the spec's settings give (no periodic saves: one save per time limit)
    current_note: str  # where current_s comes from
    lost_per_hour_optimal_s: float
    lost_per_hour_current_s: float

    def to_json(self) -> dict:
        return asdict(self)


def lost_per_hour(interval_s: float, save_s: float, mtbi_s: float) -> float:
    """Expected seconds per hour spent on saves (save_s per interval) and on work redone after interruptions
    that come at random (exponential) times: the mean time since the last save, interval/2 while the interval is
    short against the MTBI (Young's first order), all of the MTBI when it is far longer. At most the hour."""
    x = interval_s / mtbi_s
    redone = 1.0 - x / math.expm1(x) if x < 700 else 1.0  # expected loss per interruption / MTBI
    return 3600.0 * min(1.0, save_s / interval_s + redone)


def current_interval(interval_steps: int, interval_minutes: float, step_s: float | None,
                     time_limit_s: float) -> tuple[float, str]:
    """Seconds between periodic saves from checkpoint.interval_steps/interval_minutes (0: off), whichever comes
    first; with neither on (or a step time unknown for steps alone), the time limit ends each attempt with a save."""
    options = []
    if interval_steps and step_s:
        options.append((interval_steps * step_s, f"interval_steps {interval_steps} x {step_s:.3g} s"))
    if interval_minutes:
        options.append((interval_minutes * 60.0, f"interval_minutes {interval_minutes:g}"))
    if not options:
        return float(time_limit_s), "no periodic saves: one at each time limit"
    return min(options)


def advise(save_s: float, mtbi_s: float, current_s: float, current_note: str = "") -> IntervalAdvice:
    # A save that takes no measurable time would make every interval free: floor it at 10 ms.
    save_s, current_s = max(save_s, 0.01), max(current_s, 0.001)
    optimal = math.sqrt(2.0 * save_s * mtbi_s)
    return IntervalAdvice(
        save_s=save_s, mtbi_s=mtbi_s, optimal_s=optimal, current_s=current_s, current_note=current_note,
        lost_per_hour_optimal_s=lost_per_hour(optimal, save_s, mtbi_s),
        lost_per_hour_current_s=lost_per_hour(current_s, save_s, mtbi_s),
    )


def duration_text(seconds: float) -> str:
    """A short human duration: 42 s, 7.5 min, 3.2 h, 1.5 d."""
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size * 1.5 or (unit == "min" and seconds >= 90):
            return f"{seconds / size:.3g} {unit}"
    return f"{seconds:.3g} s"


def advice_lines(a: IntervalAdvice) -> list[str]:
    """The advice as the plan and the report print it."""
    return [
        (f"checkpoint interval: now every {duration_text(a.current_s)} ({a.current_note}); "
         f"Young/Daly: sqrt(2 x save {duration_text(a.save_s)} x MTBI {duration_text(a.mtbi_s)}) = "
         f"{duration_text(a.optimal_s)}"),
        (f"  expected loss per hour (saves + redone work): now {duration_text(a.lost_per_hour_current_s)}, "
         f"at the optimum {duration_text(a.lost_per_hour_optimal_s)}"),
    ]
