"""Watching a run: --wait progress streaming, log paths and --follow, and cancel."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import click

from fsdpjob.orchestrator.views import registry

from fsdpjob.orchestrator.slurm import commands as slurm_cli
from fsdpjob.orchestrator.core.errors import FsdpjobError
from fsdpjob.orchestrator.core import runlog
from fsdpjob.orchestrator.core.fileio import Tail
from fsdpjob.orchestrator.core.paths import RunPaths
from .registry import JobRecord
from .status import build_report, local_controller_alive, single_view

TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"}
# Seconds a local run gets to stop after SIGINT before fsdpjob cancel kills what is left.
LOCAL_CANCEL_GRACE_S = 15


def log_path(record: JobRecord, rank: int, stream: str = "out") -> Path:
    if not 0 <= rank < record.world_size:
        raise FsdpjobError(f"rank {rank} is out of range: this run has ranks 0..{record.world_size - 1}")
    return RunPaths(Path(record.run_dir)).rank_log(record.job_id, rank, stream)


def _terminal_phase(record: JobRecord) -> str | None:
    report = build_report(record, single_view(record))
    return report.phase if report.phase in TERMINAL else None


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
        # The last lines may land between the final poll and the phase change.
        for ev in timeline.new_entries():
            if ev["event"] == runlog.METRIC and bar:
                bar.update(task, completed=ev["step"])
    finally:
        if bar:
            bar.stop()
    report = build_report(record, single_view(record))
    click.echo(
        f"{record.run_id}: {report.phase} at step {report.step}/{record.max_steps}"
        + (f", loss {report.loss:.4f}" if report.loss is not None else "")
        + (f" ({report.failure_reason})" if report.failure_reason else ""),
        err=report.phase != "COMPLETED",
    )
    return 0 if report.phase == "COMPLETED" else 1


def _show(ev: dict, record: JobRecord, bar, task) -> None:
    if ev["event"] == runlog.METRIC:
        info = f"loss {ev['loss']:.4f}  {ev.get('tokens_per_s', 0):.0f} tok/s"
        if bar:
            bar.update(task, completed=ev["step"], info=info)
        else:
            click.echo(f"step {ev['step']}/{record.max_steps}  {info}  eta {ev.get('eta_s', 0):.0f}s")
    elif ev["event"] in (runlog.START, runlog.RESUME, runlog.STOP, runlog.FAILED, runlog.DONE, runlog.EXPORT):
        fields = " ".join(f"{k}={v}" for k, v in ev.items() if k not in ("event", "time", "pid"))
        (bar.console.print if bar else click.echo)(f"[{ev['event']}] {fields}")


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


def cancel_run(record: JobRecord) -> None:
    """Stop a run for good: Slurm jobs with requeue turned off first (slurm_cli.scancel), local runs by
    signalling their controller."""
    if record.scheduler == "slurm":
        slurm_cli.scancel(record.job_id)
        # Without accounting slurmctld forgets the job after MinJobAge; the record still says it.
        record.extra["cancelled"] = True
        registry.save(record)
        return
    pid = int(record.job_id)
    if not local_controller_alive(record):
        raise FsdpjobError(f"local run {record.run_id} is not running (pid {pid} is gone)")
    workers = _children(pid)
    record.extra["cancelled"] = True
    registry.save(record)
    # submitit's local controller turns SIGINT into SIGINT then SIGKILL for its tasks. SIGINT can be
    # ignored, though (a controller started from a script's background job inherits that): then kill.
    os.kill(pid, signal.SIGINT)
    deadline = time.monotonic() + LOCAL_CANCEL_GRACE_S
    while local_controller_alive(record) and time.monotonic() < deadline:
        time.sleep(0.2)
    folder = str(RunPaths(Path(record.run_dir)).submitit_dir).encode()
    for victim in [*workers, pid]:
        try:  # only processes still running this run (their command lines name its submitit folder)
            if folder in Path(f"/proc/{victim}/cmdline").read_bytes():
                os.kill(victim, signal.SIGKILL)
        except (OSError, ProcessLookupError):
            pass


def _children(pid: int) -> list[int]:
    """Direct children of ``pid`` (the worker ranks of a local controller)."""
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
    return out
