"""The Slurm backend's job arrays (a sweep): one array job whose task i runs in task i's own run folder, its
script from slurm/arrayrender.py, submitted in one sbatch through slurm/executor.py."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from fsdpjob.orchestrator.backend import ArrayMember, ArrayRequest, Request, Submitted
from fsdpjob.orchestrator.core.fileio import write_atomic
from fsdpjob.orchestrator.core.runfolder.paths import RunPaths

from .arrayrender import PLACEHOLDER, ArrayTask, array_plan, array_range
from .render import build_plan, render_script


def dry_run_array(array: ArrayRequest) -> Request:
    """The array job's script (pure; refuses a task that changes the job's shape)."""
    tasks = [ArrayTask(run_dir=str(t.paths.run_dir), label=t.label,
                       plan=build_plan(t.job, RunPaths(Path(PLACEHOLDER)), spec_source=array.spec_source))
             for t in array.tasks]
    span = array_range(len(array.tasks), array.max_parallel)
    script = render_script(array_plan(tasks, name=array.name, sweep_id=array.array_id, sweep_dir=str(array.folder),
                                      array=span, spec_source=array.spec_source))
    first = array.tasks[0].job
    env = {k: first.spec.env[k] for k in first.spec.secret_names()}  # as a single run's: secrets travel here only
    return Request(paths=array.tasks[0].paths, text=script, script=script, env=env, array=span)


def submit_array(array: ArrayRequest, request: Request, each: Callable[[ArrayMember, Submitted], None],
                 accounting: Callable[[], bool | None]) -> str:
    """One sbatch for the whole array; each task's job id is <array job>_<index>."""
    from fsdpjob.jobs.entry import TrainJob

    from .executor import FsdpjobArrayExecutor

    write_atomic(array.folder / "job.sbatch", request.script, mode=0o700)
    (array.folder / "submitit").mkdir(mode=0o700)
    first = array.tasks[0].job
    executor = FsdpjobArrayExecutor(array.folder / "submitit", script=request.script)
    executor.update_parameters(time=max(1, first.eff.time_limit_s // 60), signal_delay_s=first.eff.signal_lead_s)
    array_job = executor.submit_array([(t.paths.submitit_dir, TrainJob(str(t.paths.run_dir))) for t in array.tasks])
    fields = {"slurm_conf": os.environ.get("SLURM_CONF"), "extra": {"accounting": accounting()}}
    for index, task in enumerate(array.tasks):
        each(task, Submitted(job_id=f"{array_job}_{index}", record_fields={**fields, "extra": dict(fields["extra"])},
                             array_id=array_job))
    return array_job
