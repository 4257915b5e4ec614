"""The Slurm backend's export job (`fsdpjob export RUN --submit`): write the export script into the run folder and
sbatch it after the training job (slurm/exportscript.py renders it)."""

from __future__ import annotations

import time
from pathlib import Path

from fsdpjob.orchestrator.backend import ExportJob
from fsdpjob.orchestrator.core.errors import InputError
from fsdpjob.orchestrator.core.fileio import write_atomic
from fsdpjob.orchestrator.core.jobspec.profiles import ClusterProfile

from . import commands
from .exportscript import build_export_plan, render_export


def submit_export(record, profile: ClusterProfile, out: Path, dtype: str, merge: bool) -> ExportJob:
    """The export of ``record``'s run as a CPU job on ``profile``'s partition, after the run's job if it still runs."""
    if record.scheduler != "slurm":
        raise InputError(f"run {record.run_id} ran locally; export it now, without --submit", loc="--submit")
    after: str | None = record.job_id
    state = commands.job_state(record.job_id)
    if state is None or state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"):
        # Slurm refuses a dependency on a job it forgot, and an afterok on a failed one would never start.
        if state not in (None, "COMPLETED"):
            raise InputError(f"run {record.run_id}'s job {record.job_id} ended {state}: there is nothing new to "
                             "export after it; export its newest checkpoint now, without --submit", loc="--submit")
        after = None
    folder = Path(record.run_dir) / "exports"
    folder.mkdir(mode=0o700, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    log = str(folder / "export-%j.out")
    plan = build_export_plan(run_id=record.run_id, run_dir=record.run_dir, job_id=after, name=record.name,
                             profile=profile, out=str(out.resolve()), dtype=dtype, merge=merge, log=log)
    script = folder / f"export-{stamp}.sbatch"
    write_atomic(script, render_export(plan), mode=0o700)
    job_id = commands.sbatch_file(str(script))
    return ExportJob(job_id=job_id, after=after, script=script, log=log.replace("%j", job_id))
