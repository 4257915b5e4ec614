"""Watching a run: --wait progress streaming, log paths and --follow."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import click

from fsdpjob.orchestrator.backend import backend_for
from fsdpjob.orchestrator.core.errors import InputError
from fsdpjob.orchestrator.core.fileio import Tail
from fsdpjob.orchestrator.core.runfolder import runlog
from fsdpjob.orchestrator.registry import JobRecord

from .status import report_for
from .stream import stream_line

TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"}


def log_path(record: JobRecord, rank: int, stream: str = "out") -> Path:
    if not 0 <= rank < record.world_size:
        raise InputError(f"rank {rank} is out of range: this run has ranks 0..{record.world_size - 1}", file="--rank")
    return backend_for(record.scheduler).log_path(record, rank, stream)


def _terminal_phase(record: JobRecord) -> str | None:
    report = report_for(record)
    never = report.after is not None and report.after["state"] == "never"  # a chain whose parent failed
    return report.phase if report.phase in TERMINAL or never else None


def wait_for(record: JobRecord, poll_s: float = 1.0) -> int:
    """Stream progress (a bar on a terminal, plain lines otherwise) until the run ends; its exit status."""
    timeline = runlog.Follower(record.run_dir)
    bar = None
    if sys.stdout.isatty():
        from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

        bar = Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                       TimeRemainingColumn(), TextColumn("{task.fields[info]}"))
        task = bar.add_task(record.name, total=record.max_steps, info="")
        bar.start()
    phase, last_check = None, 0.0
    try:
        while True:
            for ev in timeline.new_entries():
                _show(ev, record, bar, task if bar else None)
            if time.time() - last_check >= 2 * poll_s:
                last_check = time.time()
                phase = _terminal_phase(record)
                if phase:
                    break
            time.sleep(poll_s)
        # The last lines (the done, the stop) may land between the final poll and the phase change.
        for ev in timeline.new_entries():
            _show(ev, record, bar, task if bar else None)
    finally:
        if bar:
            bar.stop()
    report = report_for(record)
    click.echo(
        f"{record.run_id}: {report.phase} "
        + (f"at step {report.step}/{record.max_steps}" if report.step else "before its first step")
        + (f", loss {report.loss:.4f}" if report.loss is not None else "")
        + (f" ({report.failure_reason})" if report.failure_reason else ""),
        err=report.phase != "COMPLETED",
    )
    return 0 if report.phase == "COMPLETED" else 1


def _show(ev: dict, record: JobRecord, bar, task) -> None:
    """One timeline entry: a training step moves the bar (a terminal) or prints its line; the rest print theirs."""
    line = stream_line(ev, record.max_steps)
    if line is None:
        return
    if bar and ev["event"] == runlog.METRIC and "eval_loss" not in ev:
        bar.update(task, completed=ev["step"], info=line)
    else:
        (bar.console.print if bar else click.echo)(line, **({"markup": False, "highlight": False} if bar else {}))


def follow_file(record: JobRecord, path: Path, poll_s: float = 0.5) -> None:
    tail = Tail(path)
    idle_checks = 0
    while True:
        for line in tail.lines():
            click.echo(line)
        idle_checks += 1
        if idle_checks % 10 == 0 and _terminal_phase(record):
            for line in tail.lines():
                click.echo(line)
            return
        time.sleep(poll_s)
