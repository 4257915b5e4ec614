"""Slurm time strings (MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS) to and from seconds."""

from __future__ import annotations

import re

_FORMS = (  # pattern, its fields' units, its name
    (re.compile(r"^(\d+)$"), ("m",), "MM"),
    (re.compile(r"^(\d+):(\d{1,2})$"), ("m", "s"), "MM:SS"),
    (re.compile(r"^(\d+):(\d{1,2}):(\d{1,2})$"), ("h", "m", "s"), "HH:MM:SS"),
    (re.compile(r"^(\d+)-(\d{1,2})$"), ("d", "h"), "D-HH"),
    (re.compile(r"^(\d+)-(\d{1,2}):(\d{1,2})$"), ("d", "h", "m"), "D-HH:MM"),
    (re.compile(r"^(\d+)-(\d{1,2}):(\d{1,2}):(\d{1,2})$"), ("d", "h", "m", "s"), "D-HH:MM:SS"),
)
_UNIT = {"d": 86400, "h": 3600, "m": 60, "s": 1}
_NAME = {"d": "days", "h": "hours", "m": "minutes", "s": "seconds"}
FORMATS_HELP = "MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS (e.g. 90, 1:30:00, 2-00:00:00)"


def parse_slurm_time(value: str | int) -> int:
    """Seconds in a Slurm time string. Raises ValueError naming the accepted formats."""
    text = str(value).strip()
    for pattern, units, form in _FORMS:
        match = pattern.match(text)
        if match:
            parts = [int(g) for g in match.groups()]
            # Sub-fields after the first must be in range, as sbatch itself requires.
            limits = {"h": 24, "m": 60, "s": 60}
            for unit, number, first in zip(units, parts, [True] + [False] * 3):
                if not first and unit in limits and number >= limits[unit]:
                    raise ValueError(f"{text!r}: {_NAME[unit]} {number} > {limits[unit] - 1} (read as {form}); "
                                     f"use {FORMATS_HELP}")
            seconds = sum(_UNIT[u] * n for u, n in zip(units, parts))
            if seconds <= 0:
                raise ValueError(f"{text!r} is zero; give a positive time limit")
            return seconds
    raise ValueError(f"{text!r} is not a Slurm time; use {FORMATS_HELP}")


def format_slurm_time(seconds: int) -> str:
    """Canonical D-HH:MM:SS (or HH:MM:SS under a day), accepted by every Slurm version."""
    days, rest = divmod(int(seconds), 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    core = f"{hours:02d}:{minutes:02d}:{secs:02d}"
    return f"{days}-{core}" if days else core
