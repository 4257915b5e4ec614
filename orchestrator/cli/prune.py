"""`fsdpjob prune`: what to remove of finished runs (their folders, or all but their newest committed checkpoint and
the best one checkpoint.keep_best keeps),
decided first and shown as a dry run; removing it is the one side effect, in ``remove``."""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import click

from fsdpjob.orchestrator import registry
from fsdpjob.orchestrator.core.runfolder.ckptlayout import committed_steps, step_dirs
from fsdpjob.orchestrator.core.runfolder.paths import is_within
from fsdpjob.orchestrator.core.runfolder.runmeta import RunMeta, checkpoint_root
from fsdpjob.orchestrator.core.runfolder.sidecar import best_step
from fsdpjob.orchestrator.registry import JobRecord

from .options import command

# Only these are over for good; PENDING, RUNNING, REQUEUED and UNKNOWN may still need their files.
FINISHED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"}
DAY_S = 86400


@dataclass(frozen=True)
class Removal:
    run_id: str
    path: Path
    size: int
    what: str  # "run folder" or "checkpoint step N"
    record: JobRecord | None  # set for a run folder: its registry record goes with it
    note: str = ""  # what stays although it might be thought to go


def tree_size(path: Path) -> int:
    """Bytes of the files under ``path`` (links not followed, not counted twice)."""
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                pass  # gone meanwhile
    return total


def _resume_sources(records: list[JobRecord], phases: dict[str, str]) -> list[Path]:
    """What runs that are not finished started from (--resume-from): a pending one has not read it yet."""
    sources = []
    for r in records:
        if phases.get(r.run_id) not in FINISHED:
            try:
                resume_from = RunMeta.read(r.run_dir).resume_from
            except (OSError, ValueError, TypeError):
                continue
            if resume_from:
                sources.append(Path(resume_from).resolve())
    return sources


def settled_phase(report) -> str:
    """A StatusReport's phase where prune may trust it: FAILED only from the scheduler itself (without it, a
    worker's failure event may be followed by a requeue that the unreachable scheduler would have shown)."""
    if report.phase == "FAILED" and report.scheduler_state == "UNKNOWN":
        return "UNKNOWN"
    return report.phase


def candidates(records: list[JobRecord], phases: dict[str, str], *, older_than_days: float | None,
               keep_last: int | None, now: float) -> list[JobRecord]:
    """Finished runs, oldest first, without the ``keep_last`` newest finished ones and those submitted less than
    ``older_than_days`` days ago."""
    finished = sorted((r for r in records if phases.get(r.run_id) in FINISHED), key=lambda r: r.submitted_at)
    if keep_last:
        finished = finished[:-keep_last]
    if older_than_days is not None:
        finished = [r for r in finished if now - r.submitted_at > older_than_days * DAY_S]
    return finished


def _keeps_best(record: JobRecord) -> bool:
    """Whether the run's spec set checkpoint.keep_best (an unreadable spec.json: assume it did, keep more)."""
    try:
        return bool(RunMeta.read(record.run_dir).section("checkpoint").get("keep_best"))
    except (OSError, ValueError, TypeError):
        return True


def _checkpoint_removals(record: JobRecord) -> list[Removal]:
    """Every step folder but the newest committed one (and, with checkpoint.keep_best, the one with the best
    eval loss, as the run's own purge keeps it), when the checkpoints are inside the run folder (a
    checkpoint.dir elsewhere may be shared with other runs: left alone)."""
    root = checkpoint_root(record.run_dir)
    if not is_within(root.resolve(), Path(record.run_dir).resolve()):
        return []
    committed = committed_steps(root)
    keep = {committed[-1][1]} if committed else set()
    if committed and _keeps_best(record) and (best := best_step(committed)) is not None:
        keep.add(best)
    return [Removal(record.run_id, p, tree_size(p), f"checkpoint step {s}", None)
            for s, p in step_dirs(root) if p not in keep]


def _run_folder_removal(record: JobRecord) -> Removal:
    """The run folder and its record; a checkpoint.dir outside the folder stays (other runs may share it)."""
    folder = Path(record.run_dir)
    root = checkpoint_root(record.run_dir)
    note = "" if is_within(root.resolve(), folder.resolve()) else f"its checkpoints in {root} stay"
    what = "run folder" if folder.is_dir() else "run folder, already gone"
    return Removal(record.run_id, folder, tree_size(folder), what, record, note)


def choose_removals(records: list[JobRecord], phases: dict[str, str], *, older_than_days: float | None = None,
         keep_last: int | None = None, checkpoints_only: bool = False, now: float | None = None) -> list[Removal]:
    """What a prune would remove; never anything of a run that is not finished, nor what one started from."""
    chosen = candidates(records, phases, older_than_days=older_than_days, keep_last=keep_last,
                        now=time.time() if now is None else now)
    protected = _resume_sources(records, phases)
    out: list[Removal] = []
    for r in chosen:
        found = _checkpoint_removals(r) if checkpoints_only else [_run_folder_removal(r)]
        out += [x for x in found if not any(is_within(src, x.path.resolve()) for src in protected)]
    return out


def remove(removals: list[Removal]) -> None:
    for x in removals:
        shutil.rmtree(x.path, ignore_errors=True)
        if x.record is not None:
            registry.forget(x.record)


def summary(removals: list[Removal], *, removed: bool) -> list[str]:
    """One line per removal, then the bytes freed (or that --yes would free)."""
    from rich.filesize import decimal

    verb = "removed" if removed else "would remove"
    lines = [f"{verb} {x.path}  ({x.run_id}: {x.what}, {decimal(x.size)}{'; ' + x.note if x.note else ''})"
             for x in removals]
    total = decimal(sum(x.size for x in removals))
    if not removals:
        return ["nothing to remove: no finished run matches"]
    if removed:
        return [*lines, f"freed {total}"]
    return [*lines, f"would free {total}; dry run, nothing removed: add --yes to remove"]


@command()
@click.option(
    "--older-than", type=click.FloatRange(min=0), metavar="DAYS", help="Only runs submitted more than DAYS days ago."
)
@click.option("--keep-last", type=click.IntRange(min=0), metavar="N", help="Keep the N newest finished runs.")
@click.option(
    "--checkpoints-only", is_flag=True, help="Keep the runs; remove all but each one's newest committed checkpoint."
)
@click.option("--yes", is_flag=True, help="Remove for real (without it: a dry run listing what would go).")
def prune(older_than: float | None, keep_last: int | None, checkpoints_only: bool, yes: bool) -> None:
    """Remove finished runs' folders (or their older checkpoints), with the bytes freed; a dry run unless --yes.

    Never touches a pending, running or requeued run, nor a checkpoint such a run was submitted to resume from."""
    from fsdpjob.orchestrator.views.status import reports

    records = registry.all_records()
    phases = {r.run_id: settled_phase(r) for r in reports(records)}
    removals = choose_removals(records, phases, older_than_days=older_than, keep_last=keep_last,
                               checkpoints_only=checkpoints_only)
    if yes:
        remove(removals)
    click.echo("\n".join(summary(removals, removed=yes)))
