"""The run log: the names of the run's events, the one append every writer uses (worker reporter, failure
policy, `fsdpjob cancel`) and the one timeline reader (status, progress, --wait, the failure policy).

Two files in the run folder, one JSON object per line: ``events.jsonl`` (lifecycle events, every rank may
write) and ``metrics.jsonl`` (one line per logged training step, rank 0). A line is written with a single
write() in append mode, so a reader never sees half an object, even with several writers across restarts.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from ..fileio import Tail
from .paths import RunPaths

# Lifecycle events, in the order a run meets them. docs/run-folder.md ("Run log events") lists the same names with
# their fields; tests/test_runlog.py keeps the two in step.
START = "start"  # an attempt's workers started: restart, world_size, job_id, host, launch, process_started_at
DATA = "data"  # data ready: sequences, examples, truncated, split, dropped, packing_efficiency, cached, seconds
RESUME = "resume"  # state loaded from a checkpoint: step, checkpoint, world_size, grad_accum_steps, load_s
REFERENCE = "reference"  # preference training's reference pass: phase (start, stopped, done), rows, seconds
READY = "ready"  # setup over, training starts at step: step, setup_s
CHECKPOINT = "checkpoint"  # a checkpoint committed (or handed to the background writer): step, reason, save_s
STAGED = "staged"  # an async save's copy is done: step (the save's), waited_s (how long the next step waited for it)
# a stop checkpoint after a signal: reason, signal, step, requeued, detail, save_s, signal_to_commit_s, handoff_s
STOP = "stop"
REQUEUE = "requeue"  # the failure policy requeued the job after a crash: reason, exit_code, detail, step
FAILED = "failed"  # an attempt failed: error or reason, retryable, step, rank (worker) or exit_code (policy)
CANCEL = "cancel"  # `fsdpjob cancel` asked the scheduler to stop the run for good: by
GPU_WAIT = "gpu_wait"  # before a relaunch, the wait for free GPUs: launch, waited_s, busy, skipped, no_gpus_seen
# the supervisor saw a crash or a stall: kind, launch, exit_code, reason, ranks, hosts, stacks, top_frames, restart,
# decision, exclude, step
FAULT = "fault"
# checkpoint.memory_interval_steps auto chose its interval: steps, stall_s, step_s, mtbi_s, at_step
MEMORY_TIER = "memory_tier"
EXPORT = "export"  # the final Hugging Face export was written: path
# grpo's generation server (supervisor): phase ready (a launch's) or replaced (a lost one, the step going on: reason,
# version loaded, detected_at, took_s), address, nodes, start (its count in the allocation)
SERVER = "server"
DONE = "done"  # training finished: step, loss

EVENTS = (START, DATA, RESUME, REFERENCE, READY, CHECKPOINT, STAGED, STOP, FAULT, GPU_WAIT, REQUEUE, FAILED, CANCEL,
          MEMORY_TIER, EXPORT, SERVER, DONE)
METRIC = "metric"  # the `event` a metrics line gets in a timeline (metrics.jsonl lines carry none)


def _append_line(path: Path, record: dict) -> None:
    # One write() of one line: a reader never sees a partial JSON object, even across restarts.
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(record, sort_keys=True) + "\n")


def append(run_dir: Path | str, event: str, **fields: object) -> dict:
    """Append one lifecycle event to the run's events.jsonl; returns the record written."""
    if event not in EVENTS:
        raise ValueError(f"unknown run event {event!r}; known: {', '.join(EVENTS)}")
    record = {"event": event, "time": time.time(), "pid": os.getpid(), **fields}
    _append_line(RunPaths(Path(run_dir)).events_file, record)
    return record


def append_metric(run_dir: Path | str, record: dict) -> None:
    """Append one logged training step (``step``, ``time`` and the values) to metrics.jsonl."""
    _append_line(RunPaths(Path(run_dir)).metrics_file, record)


def json_or_none(line: str) -> dict | None:
    """A parsed line; None for a line being written right now (not yet valid JSON)."""
    try:
        value = json.loads(line)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def _lines(path: Path, max_bytes: int | None) -> list[str]:
    """The file's lines, or only those in its last ``max_bytes`` (the first of a cut tail is dropped)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            size = f.tell()
            start = 0 if max_bytes is None else max(0, size - max_bytes)
            f.seek(start)
            data = f.read().decode("utf-8", errors="replace")
    except OSError:
        return []
    lines = data.splitlines()
    return lines[1:] if start > 0 else lines


def _parsed(path: Path, max_bytes: int | None) -> list[dict]:
    return [d for d in map(json_or_none, _lines(path, max_bytes)) if d is not None]


def read_events(run_dir: Path | str, max_bytes: int | None = None) -> list[dict]:
    return _parsed(RunPaths(Path(run_dir)).events_file, max_bytes)


def read_metrics(run_dir: Path | str, max_bytes: int | None = None) -> list[dict]:
    return _parsed(RunPaths(Path(run_dir)).metrics_file, max_bytes)


def merge(events: list[dict], metrics: list[dict]) -> list[dict]:
    """Events and metric lines (as ``event: metric``) in time order: the run's timeline."""
    return sorted(events + [dict(m, event=METRIC) for m in metrics], key=lambda e: e.get("time", 0))


def timeline(run_dir: Path | str, *, metrics: bool = True, max_bytes: int | None = None) -> list[dict]:
    """The run's events (and, with ``metrics``, its logged steps) in time order; ``max_bytes`` reads only
    that much of each file's end."""
    return merge(read_events(run_dir, max_bytes), read_metrics(run_dir, max_bytes) if metrics else [])


def first(events: list[dict], kind: str, **fields: object) -> dict | None:
    """The first event of ``kind`` (e.g. READY) in ``events`` whose ``fields`` have these values, or None."""
    return next((e for e in events if e.get("event") == kind and all(e.get(k) == v for k, v in fields.items())), None)


def since(timeline: list[dict], started: float) -> list[dict]:
    """The entries written at or after ``started``: a launch's, for the supervisor that started it then."""
    return [e for e in timeline if e.get("time", 0) >= started]


class Follower:
    """The timeline's new entries as both files grow (for --wait): complete lines only."""

    def __init__(self, run_dir: Path | str):
        paths = RunPaths(Path(run_dir))
        self._events, self._metrics = Tail(paths.events_file), Tail(paths.metrics_file)

    def new_entries(self) -> list[dict]:
        parse = lambda tail: [d for d in map(json_or_none, tail.lines()) if d is not None]  # noqa: E731
        return merge(parse(self._events), parse(self._metrics))
