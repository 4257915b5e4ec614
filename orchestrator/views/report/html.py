"""`fsdpjob report RUN --html FILE`: the report as one self-contained page (templates/report.html.j2): the
picture as an inline PNG, the attempts, the breakdown, the interruptions and the interval advice. No external
URL, no script: it opens from a file, offline, anywhere."""

from __future__ import annotations

import base64
import time
from importlib import resources

import jinja2

from fsdpjob.orchestrator.core.units import amount_text
from fsdpjob.orchestrator.planner.interval import advice_lines, duration_text
from fsdpjob.orchestrator.views.goodput import CATEGORIES

from .picture import STOP_LABELS
from .run import LABELS, LIVE_PHASES, RunReport


def _secs(value: float | None) -> str:
    return "-" if value is None else duration_text(value)


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f} %"


def _clock(t: float | None) -> str:
    return "-" if t is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def page_context(r: RunReport, png: bytes, scheduler: str) -> dict:
    """The page's values, all text already formatted: the template only lays them out."""
    g = r.goodput
    share = {k: (g.unit_seconds[k] / g.allocated_unit_s if g.allocated_unit_s else None) for k in CATEGORIES}
    return {
        "run_id": g.run_id, "phase": r.phase,
        "source": "the run's events" if g.source == "events" else f"the {scheduler} scheduler's account",
        "submitted": _clock(g.submitted_at), "ended": _clock(g.ended_at), "wall": _secs(g.wall_s),
        "ended_word": "now" if r.phase in LIVE_PHASES else "ended",
        "goodput": _pct(g.goodput), "ettr": _pct(g.ettr), "step": _secs(g.step_s), "save": _secs(g.save_s),
        "unit": g.unit, "units": g.units, "allocated": amount_text(g.allocated_unit_s),
        "attempts": [{"index": a.index, "state": a.state, "queue_wait": _secs(a.queue_wait_s), "held": _secs(a.held_s),
                      "allocated": _secs(a.allocated_s),
                      "steps": "-" if a.start_step is None else f"{a.start_step} → {a.reached_step}"}
                     for a in g.attempts],
        "breakdown": [{"part": LABELS[k], "seconds": amount_text(g.unit_seconds[k]), "share": _pct(share[k]),
                       "width": round(100 * (share[k] or 0), 2)} for k in CATEGORIES],
        "interruptions": [{"attempt": c.attempt, "kind": STOP_LABELS.get(c.kind, c.kind), "css": c.kind,
                           "where": f"step {c.step}" if c.step is not None else "set-up", "lost": _secs(c.lost_s),
                           "lost_steps": c.lost_steps, "recovered": c.recovered} for c in g.interruptions],
        "advice": advice_lines(r.advice) if r.advice else [f"checkpoint interval: {r.advice_note}"],
        "warnings": r.warnings, "picture": base64.b64encode(png).decode("ascii"),
    }


def page(r: RunReport, png: bytes, scheduler: str) -> str:
    """The HTML text. Autoescaped: run names, error texts and recovery notes are the user's or a job's words."""
    text = resources.files("fsdpjob.templates").joinpath("report.html.j2").read_text(encoding="utf-8")
    env = jinja2.Environment(undefined=jinja2.StrictUndefined, autoescape=True, keep_trailing_newline=True)
    return env.from_string(text).render(page_context(r, png, scheduler))
