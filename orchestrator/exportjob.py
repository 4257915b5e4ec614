"""Side effects of `fsdpjob export RUN --submit`: write the export script into the run folder and sbatch it
after the training job (orchestrator/slurm/exportscript.py renders it)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from fsdpjob.orchestrator.core.errors import InputError
from fsdpjob.orchestrator.core.fileio import write_atomic
from fsdpjob.orchestrator.core.profiles import ClusterProfile
from fsdpjob.orchestrator.registry import JobRecord


@dataclass(frozen=True)
class ExportJob:
    job_id: str
    after: str | None  # the training job it waits for
    script: Path
    log: str


def submit_export(record: JobRecord, profile: ClusterProfile, out: Path, dtype: str, merge: bool) -> ExportJob:
    from fsdpjob.orchestrator.slurm import commands
    from fsdpjob.orchestrator.slurm.exportscript import build_export_plan, render_export

    if profile.scheduler != "slurm":
        raise InputError(f"profile {profile.name!r} is local: run `fsdpjob export` without --submit", loc="--submit")
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
