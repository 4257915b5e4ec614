"""Side effects of submitting and cancelling, all here: run folder, resolved spec, script, the backend's
submit, the registry record; cancel's scheduler call, run-log event and registry mark."""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from fsdpjob.orchestrator import registry
from fsdpjob.orchestrator.backend import ArrayMember, ArrayRequest, Request, Submitted, backend_for, job_environment
from fsdpjob.orchestrator.core.errors import FsdpjobError, InputError, SubmissionError
from fsdpjob.orchestrator.core.fileio import write_atomic
from fsdpjob.orchestrator.core.runfolder import runlog
from fsdpjob.orchestrator.core.runfolder.paths import RunPaths, new_run_id, runs_root
from fsdpjob.orchestrator.core.runfolder.runmeta import EffectiveFacts, RunMeta
from fsdpjob.orchestrator.core.runfolder.sweepstate import SweepState, SweepTask
from fsdpjob.orchestrator.planner.jobload import LoadedJob
from fsdpjob.orchestrator.registry import JobRecord


@dataclass(frozen=True)
class Submission:
    record: JobRecord
    paths: RunPaths


@contextlib.contextmanager
def owner_only():
    """Files and folders created meanwhile are the owner's only: here (run folder, registry), by the local
    workers (they inherit the umask) and by the Slurm job (sbatch passes it on as SLURM_UMASK), so logs,
    metrics and checkpoints are never readable by other users."""
    previous = os.umask(0o077)
    try:
        yield
    finally:
        os.umask(previous)


def _claim_run_folder(name: str, run_dir: Path | None) -> RunPaths:
    """Create a new run folder. mkdir is the claim: two submits of one name in the same second (run ids differ
    by 2 random bytes) never share a folder; the second draws another id."""
    for _ in range(100):
        paths = RunPaths(run_dir or runs_root() / new_run_id(name))
        paths.run_dir.parent.mkdir(parents=True, exist_ok=True)
        try:
            paths.run_dir.mkdir(mode=0o700)
            return paths
        except FileExistsError:
            if run_dir is not None:
                raise InputError(f"run folder {run_dir} already exists; pick another", file="--run-dir") from None
    raise SubmissionError(f"no free run folder name under {paths.run_dir.parent} in 100 tries")


def request_json(job: LoadedJob, request: Request, plan: dict) -> dict:
    """`submit --dry-run --json`: the request as data. The submission environment by name only: its values
    may be secret. ``text`` is what the plain dry run prints (the script, or for a local run what starts)."""
    return {"profile": job.profile.name, "scheduler": job.profile.scheduler, "run_dir": str(request.paths.run_dir),
            "script": request.script, "text": request.text, "environment": sorted(request.env), "plan": plan}


def write_run_folder(job: LoadedJob, paths: RunPaths, script: str | None, resume_from: str | None,
                      worker_facts: dict, files: tuple[tuple[str, str], ...] = ()) -> None:
    paths.submitit_dir.mkdir(mode=0o700)
    eff = job.eff
    RunMeta.of(
        job.spec.redacted(),
        spec_source=str(Path(job.source).resolve()),
        profile=job.profile.model_dump(mode="json"),
        effective=EffectiveFacts(
            nodes=eff.nodes, tasks_per_node=eff.tasks_per_node, world_size=eff.world_size, signal=eff.signal,
            signal_lead_s=eff.signal_lead_s, time_limit_s=eff.time_limit_s, scheduler=eff.scheduler,
        ),
        # Absolute: the workers and status's lineage read it from other folders than the one it was given in.
        resume_from=str(Path(resume_from).resolve()) if resume_from else None,
        worker_facts=worker_facts,
    ).write(paths)
    if script is not None:
        write_atomic(paths.sbatch_file, script, mode=0o700)
    for name, text in files:
        (paths.run_dir / name).parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        write_atomic(paths.run_dir / name, text)


def submit(job: LoadedJob, *, run_dir: Path | None = None, resume_from: str | None = None,
           worker_facts: dict | None = None, extra: dict | None = None) -> Submission:
    """Create the run folder, submit, record. On failure nothing is recorded and the folder is removed.
    ``worker_facts`` (the planner's, planner/fit.FitPlan.worker_facts) go to the workers through spec.json;
    ``extra`` goes into the record's extra (a chain's parent, orchestrator/cli/chain.py)."""
    backend = backend_for(job.profile.scheduler)
    with owner_only():
        paths = _claim_run_folder(job.spec.name, run_dir)
        try:
            request = backend.dry_run(job, paths)
            write_run_folder(job, paths, request.script, resume_from, worker_facts or {}, request.files)
        except BaseException:
            shutil.rmtree(paths.run_dir, ignore_errors=True)
            raise
        try:
            with job_environment(request.env):
                submitted = backend.submit(job, request)
        except Exception as exc:  # whatever sbatch or submitit says, the user gets it in one line
            shutil.rmtree(paths.run_dir, ignore_errors=True)
            raise SubmissionError(f"submission failed, nothing was recorded: {sbatch_reason(exc)}") from None
        record = _record(job, paths, backend.name, submitted)
        record.extra.update(extra or {})
        registry.save(record)
        return Submission(record=record, paths=paths)


def _record(job: LoadedJob, paths: RunPaths, scheduler: str, submitted: Submitted) -> JobRecord:
    return JobRecord(
        run_id=paths.run_id,
        name=job.spec.name,
        run_dir=str(paths.run_dir),
        scheduler=scheduler,
        job_id=submitted.job_id,
        profile=job.profile.name,
        submitted_at=time.time(),
        spec_hash=job.spec.spec_hash(),
        nodes=job.eff.nodes,
        tasks_per_node=job.eff.tasks_per_node,
        gpus_per_node=job.eff.gpus_per_node,
        max_steps=job.spec.train.max_steps,
        **submitted.record_fields,
    )


def dry_run_array(array: ArrayRequest) -> Request:
    """What a submit of the array would send, touching nothing (refusals of its tasks come from here)."""
    return backend_for(array.tasks[0].job.profile.scheduler).dry_run_array(array)


def submit_array(array: ArrayRequest, on_submitted: Callable[[JobRecord], None] | None = None) -> list[JobRecord]:
    """A job array through its backend: every task's run folder written first, then the hand-over; a record per
    task as it is handed over (``on_submitted`` follows each). On failure what was not recorded is removed
    (all of it, where the scheduler takes the array in one call)."""
    backend = backend_for(array.tasks[0].job.profile.scheduler)
    request = backend.dry_run_array(array)  # refusals come before any folder is made
    records: list[JobRecord] = []

    def each(task: ArrayMember, submitted: Submitted) -> None:
        record = _record(task.job, task.paths, backend.name, submitted)
        record.sweep = {**task.sweep, "job_id": submitted.array_id}
        registry.save(record)
        records.append(record)
        if on_submitted is not None:
            on_submitted(record)

    with owner_only():
        array.folder.mkdir(parents=True, mode=0o700)
        try:
            for task in array.tasks:
                task.paths.run_dir.mkdir(mode=0o700)
                write_run_folder(task.job, task.paths, request.script, None, task.worker_facts)
            # Before the hand-over: each task's batch side counts its end in this file and the last one tells
            # sweep_done; the local backend's runs all end before submit_array returns, and a Slurm task may fail
            # within seconds. Rewritten with the array job's id once there is one.
            _sweep_state(array, request, None).write(array.folder)
            with job_environment(request.env):
                backend.submit_array(array, request, each)
            if records:
                _sweep_state(array, request, records[0].sweep["job_id"]).write(array.folder)
        except Exception as exc:  # whatever sbatch says, in one line, and nothing left behind
            _remove_unrecorded(array, records)
            if isinstance(exc, FsdpjobError):
                raise
            raise SubmissionError(f"sweep submission failed, {_kept(records)}: {sbatch_reason(exc)}") from None
    return records


def _sweep_state(array: ArrayRequest, request: Request, job_id: str | None) -> SweepState:
    return SweepState(id=array.array_id, name=array.name, job_id=job_id, array=request.array,
                      runs=tuple(SweepTask(t.sweep["index"], t.paths.run_id, t.sweep["values"]) for t in array.tasks))


def _remove_unrecorded(array: ArrayRequest, records: list[JobRecord]) -> None:
    if not records:
        shutil.rmtree(array.folder, ignore_errors=True)
        return
    recorded = {r.run_dir for r in records}
    for task in array.tasks:
        if str(task.paths.run_dir) not in recorded:
            shutil.rmtree(task.paths.run_dir, ignore_errors=True)


def _kept(records: list[JobRecord]) -> str:
    return f"{len(records)} run(s) were recorded before it" if records else "nothing was recorded"


def cancel(record: JobRecord) -> str:
    """Stop a run for good. The run log and the record both say so: status shows CANCELLED after a
    scheduler without accounting has forgotten the job, and the local backend's view reads the mark."""

    def mark() -> None:
        runlog.append(record.run_dir, runlog.CANCEL, by="fsdpjob cancel")
        record.extra["cancelled"] = True
        registry.save(record)

    return backend_for(record.scheduler).cancel(record, mark=mark)


def sbatch_reason(exc: BaseException) -> str:
    """sbatch's own words, without submitit's wrapping noise."""
    text = str(exc)
    for marker in ("sbatch: error:", "error:"):
        if marker in text:
            lines = [ln.strip() for ln in text.splitlines() if marker in ln]
            if lines:
                return " ".join(lines)
    return " ".join(text.split())[:500]
