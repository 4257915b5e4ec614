"""How often the training ranks agree on stopping and saving, and how long a stop can wait for it.

Shared by the worker's loop (jobs/agreement.py, which runs the rule) and the planner's signal-lead check
(planner/timing.py, which counts its bound), so the two cannot drift apart.

The ranks agree on their stop signal and on rank 0's clock for ``interval_minutes`` with one small host
collective, started before a step and read after it (it travels while the step trains). A step of a second
or more carries one every step. Shorter steps carry one every ``k`` steps, ``k`` steps being about
``AGREE_EVERY_S``: at a 40 ms step an all-gather per step was about 1 % of it on 2 CPU cores, and
each one is a point where a rank that runs late makes the other wait.
"""

from __future__ import annotations

import math

AGREE_EVERY_S = 0.5  # the aimed-for time between two agreements
MAX_STEPS_BETWEEN = 100  # however short the step: a bound the planner can count without knowing the step time
# A signal is sampled when an agreement starts and acted on when the step that carries it ends. Arriving just
# after one started, it waits for the steps until the next (at most about AGREE_EVERY_S, or one step when a
# step is longer), then for the step that carries it.
STEPS_BEFORE_STOP = 2


def steps_between(step_s: float | None) -> int:
    """Steps from one agreement to the next, for a measured step time (None or 0: unknown, every step)."""
    if not step_s or step_s <= 0 or not math.isfinite(step_s):
        return 1
    return max(1, min(MAX_STEPS_BETWEEN, int(AGREE_EVERY_S / step_s)))


def stop_wait_s(step_s: float) -> float:
    """The longest a stop signal waits before its checkpoint save starts: up to the next agreement, then
    the step that carries it (two steps when steps are at least AGREE_EVERY_S long)."""
    return STEPS_BEFORE_STOP * step_s + AGREE_EVERY_S
