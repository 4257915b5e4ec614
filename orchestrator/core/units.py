"""Units and the way sizes, counts and amounts are written in the planner's and the reports' tables and notes."""

from __future__ import annotations

GiB = 1024**3
GB = 10**9


def unit_for(largest: int) -> tuple[str, int]:
    """GiB for tables that reach a GiB, MiB below (a CPU quickstart fits in a few MiB)."""
    return ("GiB", GiB) if largest >= GiB else ("MiB", 1024**2)


def size_text(n: int | None, unit: tuple[str, int]) -> str:
    return "?" if n is None else f"{n / unit[1]:,.2f}" if n < 10 * unit[1] else f"{n / unit[1]:,.1f}"


def params_text(n: int) -> str:
    for scale, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "k")):
        if n >= scale:
            return f"{n / scale:.3g} {suffix}"
    return str(n)


def amount_text(value: float) -> str:
    """A quantity such as seconds or rank-seconds at a precision that fits it: whole from 100 up (with
    thousands separators), three significant digits below (0.42, 7.5, 12.3): a 16 s CPU run's parts are not 0."""
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}"


def count_text(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"
