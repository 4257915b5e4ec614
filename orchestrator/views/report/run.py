"""`fsdpjob report RUN`: one run's goodput report (read from the scheduler's account of its attempts, the
whole run log and spec.json), its text, and checkpoint interval advice from the interruptions it saw."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from fsdpjob.orchestrator.backend import backend_for
from fsdpjob.orchestrator.core.errors import FsdpjobError
from fsdpjob.orchestrator.core.runfolder import runlog
from fsdpjob.orchestrator.core.runfolder.runmeta import RunMeta
from fsdpjob.orchestrator.core.units import amount_text
from fsdpjob.orchestrator.planner.interval import IntervalAdvice, advice_lines, advise, current_interval, duration_text
from fsdpjob.orchestrator.registry import JobRecord
from fsdpjob.orchestrator.views.goodput import CATEGORIES, GoodputReport, goodput
from fsdpjob.orchestrator.views.status import build_report

LIVE_PHASES = ("PENDING", "RUNNING", "REQUEUED")
# Stops that come with a warning: the workers save first, so they lose no work whatever the interval.
SIGNALLED = ("preemption", "time_limit", "requeue", "cancel", "signal", "teardown")
LABELS = {"launch": "launch of the workers", "startup": "start-up", "reference": "reference pass",
          "productive": "productive",
          "checkpoint": "checkpoint saves", "lost": "lost work", "hang": "hang", "teardown": "stop and teardown",
          "unexplained": "unexplained"}
_LABEL_WIDTH = max(map(len, LABELS.values())) + 2


@dataclass
class RunReport:
    goodput: GoodputReport
    phase: str
    advice: IntervalAdvice | None
    advice_note: str
    warnings: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return {**self.goodput.to_json(), "phase": self.phase,
                "advice": self.advice.to_json() if self.advice else None, "advice_note": self.advice_note}


def run_report(record: JobRecord) -> RunReport:
    """The report of one run: the scheduler's times where it keeps them, else the run's events."""
    backend, warnings = backend_for(record.scheduler), []
    try:
        phase = build_report(record, backend.view(record)).phase
    except FsdpjobError as exc:
        phase = build_report(record, None).phase
        warnings.append(f"scheduler not reachable ({exc}); phase from the run's events")
    try:
        attempts = backend.attempts(record)
    except FsdpjobError as exc:
        attempts = None
        warnings.append(f"no scheduler account of the attempts ({exc}); times from the run's events")
    now = time.time() if phase in LIVE_PHASES else None
    rep = goodput(record, attempts, runlog.read_events(record.run_dir), runlog.read_metrics(record.run_dir), now=now)
    advice, note = interval_advice(rep, _run_meta(record))
    return RunReport(rep, phase, advice, note, warnings)


def _run_meta(record: JobRecord) -> RunMeta | None:
    try:
        return RunMeta.read(record.run_dir)
    except (OSError, ValueError):
        return None


def interval_advice(rep: GoodputReport, meta: RunMeta | None) -> tuple[IntervalAdvice | None, str]:
    """Young/Daly from the measured save time and the mean allocated time between the interruptions that lost
    work (signalled stops save first and lose none; a cancel, the user's own, says nothing of how often the
    cluster interrupts a run)."""
    losing = [c for c in rep.interruptions if c.kind != "cancel" and (c.kind not in SIGNALLED or c.lost_s > 0)]
    if rep.save_s is None:
        return None, "no checkpoint save measured yet"
    if not losing:
        return None, ("no interruption lost work (signalled stops save first): periodic saves only cost "
                      f"{duration_text(rep.save_s)} each")
    ckpt = meta.section("checkpoint") if meta else {}
    limit = float(meta.effective.time_limit_s or 0) if meta else 0.0
    limit = limit or sum(a.allocated_s for a in rep.attempts)
    current, how = current_interval(int(ckpt.get("interval_steps") or 0), float(ckpt.get("interval_minutes") or 0),
                                    rep.step_s, limit)
    mtbi = sum(a.allocated_s for a in rep.attempts) / len(losing)
    return advise(rep.save_s, mtbi, current, how), f"{len(losing)} interruption(s) lost work"


def _clock(t: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if t is not None else "-"


def _secs(value: float | None) -> str:
    return "-" if value is None else duration_text(value)


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f} %"


# Where the attempts' times come from (GoodputReport.source), as the report's first line names it.
SOURCES = {"sacct": "sacct", "local": "the local processes (from the submit to their last write)",
           "events": "the run's events (no scheduler account)"}


def format_report(r: RunReport) -> str:
    g = r.goodput
    lines = [
        f"run {g.run_id}: {r.phase}; attempt times from {SOURCES.get(g.source, g.source)}",
        (f"  submitted {_clock(g.submitted_at)}, {'now' if r.phase in LIVE_PHASES else 'ended'} "
         f"{_clock(g.ended_at)}: wall {_secs(g.wall_s)}"),
        "",
        f"  {'attempt':<8}{'state':<12}{'queue wait (held)':<20}{'allocated (wall)':<18}steps",
    ]
    for a in g.attempts:
        steps = "-" if a.start_step is None else f"{a.start_step} -> {a.reached_step}"
        lines.append(f"  {a.index:<8}{a.state:<12}{_secs(a.queue_wait_s) + ' (' + _secs(a.held_s) + ')':<20}"
                     f"{_secs(a.allocated_s):<18}{steps}")
    units = f"{g.units} {g.unit}{'s' if g.units != 1 else ''}"
    wall = g.allocated_unit_s / g.units if g.units else 0.0
    lines += ["", f"allocated {amount_text(g.allocated_unit_s)} {g.unit}-seconds ({units} x {_secs(wall)}):"]
    for k in CATEGORIES:
        share = g.unit_seconds[k] / g.allocated_unit_s if g.allocated_unit_s else None
        lines.append(f"  {LABELS[k]:<{_LABEL_WIDTH}}{amount_text(g.unit_seconds[k]):>10} {g.unit}-s  {_pct(share):>8}")
        if k == "productive" and g.productive_split:  # grpo: its generation, then its training
            for part, seconds in g.productive_split.items():
                of = seconds / g.productive_unit_s if g.productive_unit_s else None
                lines.append(f"    {part:<{_LABEL_WIDTH - 2}}{amount_text(seconds):>10} {g.unit}-s  {_pct(of):>8} "
                             "of productive")
    lines += ["", f"goodput {_pct(g.goodput)} (productive / allocated); "
                  f"ETTR {_pct(g.ettr)} (productive / (end - submit))"]
    if g.step_s is not None or g.save_s is not None:
        lines.append(f"measured: step {_secs(g.step_s)}, blocking save {_secs(g.save_s)}")
    lines += ["", "interruptions:" if g.interruptions else "interruptions: none"]
    for c in g.interruptions:
        where = f"at step {c.step}" if c.step is not None else "in set-up"
        lines.append(f"  attempt {c.attempt}: {c.kind} {where}, lost "
                     f"{_secs(c.lost_s)} ({c.lost_steps} steps); {c.recovered}")
    lines += [""] + (advice_lines(r.advice) if r.advice else [f"checkpoint interval: {r.advice_note}"])
    return "\n".join(lines)
