"""Learning-rate schedule: linear warmup, then cosine, linear or constant decay (a pure function of step)."""

from __future__ import annotations

import math


def lr_factor(step: int, *, max_steps: int, warmup_steps: int, schedule: str, min_lr_ratio: float) -> float:
    """Multiplier of the peak lr for optimizer step ``step`` (0-based, the step about to be taken)."""
    if warmup_steps and step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    span = max(1, max_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    if schedule == "linear":
        decay = 1.0 - progress
    elif schedule == "cosine":
        decay = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        raise ValueError(f"unknown lr_schedule {schedule!r}")
    return min_lr_ratio + (1.0 - min_lr_ratio) * decay
