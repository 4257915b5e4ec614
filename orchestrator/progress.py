"""Training progress read from a run folder (metrics.jsonl, events.jsonl, checkpoints/): pure file reads."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from .ckptlayout import committed_steps, run_checkpoint_root
from .paths import RunPaths



def _tail_lines(path: Path, max_bytes: int = 65536) -> list[str]:
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            size = f.tell()
            f.seek(max(0, size - max_bytes))
            data = f.read().decode("utf-8", errors="replace")
    except OSError:
        return []
    lines = data.splitlines()
    return lines[1:] if size > max_bytes else lines  # the first line of a tail may be cut


def _json_lines(lines: list[str]) -> list[dict]:
    """Parsed lines; a line being written right now (not yet valid JSON) is skipped."""
    return [d for d in map(_json_or_none, lines) if d is not None]


def _json_or_none(line: str) -> dict | None:
    try:
        return json.loads(line)
    except ValueError:
        return None


@dataclass
class Progress:
    step: int | None = None
    loss: float | None = None
    tokens_per_s: float | None = None
    eta_s: float | None = None
    last_checkpoint_step: int | None = None
    starts: int = 0
    steps_lost: int = 0
    done: bool = False
    failure: str | None = None
    last_stop: dict | None = None
    events: list[dict] = field(default_factory=list)

    @property
    def restarts(self) -> int:
        return max(0, self.starts - 1)


def read_progress(run_dir: Path, checkpoints_dir: Path | None = None) -> Progress:
    paths = RunPaths(run_dir)
    prog = Progress()
    metric_lines = _tail_lines(paths.metrics_file)
    last = next((m for m in map(_json_or_none, reversed(metric_lines)) if m), None)
    if last:
        prog.step, prog.loss = last.get("step"), last.get("loss")
        prog.tokens_per_s, prog.eta_s = last.get("tokens_per_s"), last.get("eta_s")
    events = _json_lines(_tail_lines(paths.events_file, 1 << 20))
    prog.events = events
    # Metrics matter for steps lost only when the run started more than once; most runs did not.
    metrics = _json_lines(metric_lines) if sum(e.get("event") == "start" for e in events) > 1 else []
    # Steps lost: work done in an attempt beyond the step the next attempt resumed from (time-ordered).
    timeline = sorted(events + [dict(m, event="metric") for m in metrics], key=lambda e: e.get("time", 0))
    reached = 0
    for ev in timeline:
        kind = ev.get("event")
        if kind == "start":
            prog.starts += 1
            prog.done, prog.failure = False, None
        elif kind in ("resume", "ready"):
            # Where an attempt starts training: a resume's step, or 0 after a crash before any checkpoint.
            prog.steps_lost += max(0, reached - int(ev.get("step", 0)))
            reached = int(ev.get("step", 0))
        elif kind == "done":
            prog.done = True
            prog.step = ev.get("step", prog.step)
        elif kind == "failed":
            prog.failure = ev.get("reason") or ev.get("error")
        elif kind == "stop":
            prog.last_stop = ev
        if kind in ("stop", "checkpoint", "metric", "failed", "requeue") and isinstance(ev.get("step"), int):
            # Failure events carry the step a crash reached: older metrics may be past the tail read.
            reached = max(reached, ev["step"])
    steps = committed_steps(checkpoints_dir or run_checkpoint_root(run_dir))  # honours checkpoint.dir
    prog.last_checkpoint_step = steps[-1][0] if steps else None
    return prog
