"""Submission side effects, all here: run folder, resolved spec, script, submitit submit, registry record."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from fsdpjob.orchestrator.views import registry
from fsdpjob.orchestrator.core.errors import SubmissionError
from fsdpjob.orchestrator.planner.jobload import LoadedJob
from fsdpjob.orchestrator.core.paths import RunPaths, new_run_id, runs_root
from fsdpjob.orchestrator.core.fileio import write_atomic
from fsdpjob.orchestrator.views.registry import JobRecord
from fsdpjob.orchestrator.slurm.render import SbatchPlan, build_plan, render_script


@dataclass(frozen=True)
class Submission:
    record: JobRecord
    paths: RunPaths


def dry_run(job: LoadedJob, run_dir: Path | None = None) -> tuple[RunPaths, SbatchPlan | None, str]:
    """What would be submitted, touching nothing: (paths, plan, script text or local description)."""
    paths = RunPaths(run_dir or runs_root() / new_run_id(job.spec.name))
    if job.profile.scheduler == "local":
        text = (
            f"# local profile: {job.eff.tasks_per_node} worker process(es) on this machine through submitit's "
            f"local executor\n# run folder: {paths.run_dir}\n"
        )
        return paths, None, text
    plan = build_plan(job.spec, job.profile, paths, spec_source=job.source)
    return paths, plan, render_script(plan)


@contextlib.contextmanager
def _job_environment(env: dict[str, str]):
    """Environment for the submission call: sbatch exports it to the job (secrets travel this way, never
    through a file), and submitit's local executor passes it to the workers."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def _owner_only():
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
                raise SubmissionError(f"run folder {run_dir} already exists; pick another --run-dir") from None
    raise SubmissionError(f"no free run folder name under {paths.run_dir.parent} in 100 tries")


def _write_run_folder(job: LoadedJob, paths: RunPaths, script: str | None, resume_from: str | None) -> None:
    paths.submitit_dir.mkdir(mode=0o700)
    resolved = job.spec.redacted().model_dump(mode="json")
    meta = {
        "spec": resolved,
        "spec_hash": job.spec.spec_hash(),
        "spec_source": str(Path(job.source).resolve()),
        "profile": job.profile.model_dump(mode="json"),
        "effective": {
            "nodes": job.eff.nodes,
            "tasks_per_node": job.eff.tasks_per_node,
            "world_size": job.eff.world_size,
            "signal": job.eff.signal,
            "signal_lead_s": job.eff.signal_lead_s,
            "time_limit_s": job.eff.time_limit_s,
            "scheduler": job.eff.scheduler,
        },
        "resume_from": resume_from,
    }
    write_atomic(paths.spec_file, json.dumps(meta, indent=1, sort_keys=True))
    if script is not None:
        write_atomic(paths.sbatch_file, script, mode=0o700)


def _submit_slurm(job: LoadedJob, paths: RunPaths, plan: SbatchPlan):
    from fsdpjob.orchestrator.slurm.executor import FsdpjobSlurmExecutor
    from fsdpjob.jobs.entry import TrainJob

    executor = FsdpjobSlurmExecutor(paths.submitit_dir, plan=plan, python=job.profile.python or sys.executable)
    executor.update_parameters(time=max(1, job.eff.time_limit_s // 60), signal_delay_s=job.eff.signal_lead_s)
    return executor.submit(TrainJob(str(paths.run_dir)))


def _submit_local(job: LoadedJob, paths: RunPaths):
    import submitit

    from fsdpjob.jobs.entry import TrainJob

    executor = submitit.LocalExecutor(folder=str(paths.submitit_dir))
    executor.update_parameters(
        tasks_per_node=job.eff.tasks_per_node,
        nodes=1,
        timeout_min=job.eff.time_limit_s / 60,
        signal_delay_s=job.eff.signal_lead_s,
    )
    with _stdio_detached():
        return executor.submit(TrainJob(str(paths.run_dir)))


@contextlib.contextmanager
def _stdio_detached():
    """Start submitit's local controller the way nohup would: it outlives this process, like a batch job.

    It inherits fds 0-2: on the caller's pipes it would make `out=$(fsdpjob submit ...)` (or any captured
    run) wait for the whole job, so it gets /dev/null (the workers write to their own log files). And it
    inherits signal dispositions across exec: SIGHUP ignored, so closing the terminal does not kill the
    run. SIGINT keeps (or gets back) its default: `fsdpjob cancel` and Ctrl-C under --wait stop a local run with it.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(fd) for fd in (0, 1, 2)]
    devnull = os.open(os.devnull, os.O_RDWR)
    in_main = threading.current_thread() is threading.main_thread()  # signal.signal works only there
    old_hup = signal.signal(signal.SIGHUP, signal.SIG_IGN) if in_main else None
    # An ignored SIGINT (this CLI run as a script's background job) would be inherited too, and the
    # controller would then ignore `fsdpjob cancel`: it gets the default back.
    old_int = signal.getsignal(signal.SIGINT)
    if in_main and old_int == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
    try:
        for fd in (0, 1, 2):
            os.dup2(devnull, fd)
        yield
    finally:
        if in_main:
            signal.signal(signal.SIGHUP, old_hup)
            signal.signal(signal.SIGINT, old_int)
        for fd, copy in zip((0, 1, 2), saved):
            os.dup2(copy, fd)
            os.close(copy)
        os.close(devnull)


def submit(job: LoadedJob, *, run_dir: Path | None = None, resume_from: str | None = None) -> Submission:
    """Create the run folder, submit, record. On failure nothing is recorded and the folder is removed."""
    with _owner_only():
        paths = _claim_run_folder(job.spec.name, run_dir)
        try:
            _, plan, script = dry_run(job, paths.run_dir)
            _write_run_folder(job, paths, script if plan else None, resume_from)
        except BaseException:
            shutil.rmtree(paths.run_dir, ignore_errors=True)
            raise
        return _submit_and_record(job, paths, plan)


def _submit_and_record(job: LoadedJob, paths: RunPaths, plan: SbatchPlan | None) -> Submission:
    env = dict(job.profile.env) if job.profile.scheduler == "local" else {}
    env.update(job.spec.env if job.profile.scheduler == "local" else {k: job.spec.env[k] for k in job.spec.secret_names()})
    env["FSDPJOB_RUN_DIR"] = str(paths.run_dir)
    if job.profile.scheduler == "local" and job.eff.cpus_per_task:
        env.setdefault("OMP_NUM_THREADS", str(job.eff.cpus_per_task))
    try:
        with _job_environment(env):
            handle = _submit_slurm(job, paths, plan) if plan else _submit_local(job, paths)
    except Exception as exc:  # noqa: BLE001 - whatever sbatch or submitit says, the user gets it in one line
        shutil.rmtree(paths.run_dir, ignore_errors=True)
        raise SubmissionError(f"submission failed, nothing was recorded: {_reason(exc)}") from None
    record = JobRecord(
        run_id=paths.run_id,
        name=job.spec.name,
        run_dir=str(paths.run_dir),
        scheduler=job.profile.scheduler,
        job_id=str(handle.job_id),
        profile=job.profile.name,
        submitted_at=time.time(),
        spec_hash=job.spec.spec_hash(),
        nodes=job.eff.nodes,
        tasks_per_node=job.eff.tasks_per_node,
        max_steps=job.spec.train.max_steps,
        slurm_conf=os.environ.get("SLURM_CONF") if plan else None,
        extra={"accounting": _accounting() if plan else None},
    )
    registry.save(record)
    return Submission(record=record, paths=paths)


def _accounting() -> bool | None:
    from fsdpjob.orchestrator.slurm.commands import accounting_enabled

    try:
        return accounting_enabled()
    except Exception:  # noqa: BLE001 - status falls back to squeue/scontrol when unknown
        return None


def _reason(exc: BaseException) -> str:
    """sbatch's own words, without submitit's wrapping noise."""
    text = str(exc)
    for marker in ("sbatch: error:", "error:"):
        if marker in text:
            lines = [ln.strip() for ln in text.splitlines() if marker in ln]
            if lines:
                return " ".join(lines)
    return " ".join(text.split())[:500]
