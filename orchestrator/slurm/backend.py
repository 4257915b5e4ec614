"""The Slurm backend: sbatch through submitit with fsdpjob's script, views from sacct (or squeue/scontrol
without accounting), cancel with requeue turned off first."""

from __future__ import annotations

import os
from pathlib import Path

from fsdpjob.orchestrator.backend import AttemptTimes, Request, SchedView, Submitted, Unsupported
from fsdpjob.orchestrator.core.errors import InputError
from fsdpjob.orchestrator.core.runfolder.paths import RunPaths

from . import arrayjob, commands
from .render import build_plan, render_script


class SlurmBackend:
    name = "slurm"
    account = "sacct"
    foreground = False  # a job goes on without the command that submitted it; `fsdpjob wait` re-attaches
    host_from_events = False  # a job's nodes come from Slurm alone (rank 0's host is one node of several)

    def dry_run(self, job, paths: RunPaths) -> Request:
        plan = build_plan(job, paths, spec_source=job.source, dependency=getattr(job, "dependency", None))
        script = render_script(plan)
        # Only secrets travel through the submission environment (sbatch exports it); the rest is in the script.
        env = {k: job.spec.env[k] for k in job.spec.secret_names()}
        env["FSDPJOB_RUN_DIR"] = str(paths.run_dir)
        return Request(paths=paths, text=script, script=script, env=env, payload=plan, files=plan.files)

    def submit(self, job, request: Request) -> Submitted:
        from fsdpjob.jobs.entry import TrainJob

        from .executor import FsdpjobSlurmExecutor

        paths = request.paths
        executor = FsdpjobSlurmExecutor(paths.submitit_dir, plan=request.payload, python=request.payload.worker_python)
        executor.update_parameters(time=max(1, job.eff.time_limit_s // 60), signal_delay_s=job.eff.signal_lead_s)
        handle = executor.submit(TrainJob(str(paths.run_dir)))
        return Submitted(
            job_id=str(handle.job_id),
            record_fields={"slurm_conf": os.environ.get("SLURM_CONF"), "extra": {"accounting": accounting_known()}},
        )

    def views(self, records) -> dict[str, SchedView]:
        """One scheduler call for all records (sacct with accounting, squeue without)."""
        ids = [r.job_id for r in records]
        if not ids:
            return {}
        rows = _sacct_rows(records)
        if rows is not None:
            return views_from_sacct(rows)
        return views_from_squeue(commands.squeue(ids))

    def view(self, record) -> SchedView:
        """scontrol while slurmctld still knows the job (restarts, reason), else sacct/squeue."""
        info = commands.scontrol_job(record.job_id)
        if info:
            return view_from_scontrol(info)
        return self.views([record]).get(record.job_id, SchedView(state="UNKNOWN"))

    def attempts(self, record) -> list[AttemptTimes] | None:
        """sacct -D: one row per run of the job (each restart), with its queue, eligible, start and end times."""
        rows = _sacct_rows([record])
        if rows is None:
            return None
        return list(attempts_from_sacct(rows).get(record.job_id, ())) or None

    def cancel(self, record, *, mark) -> str:
        commands.scancel(record.job_id)
        mark()  # without accounting slurmctld forgets the job after MinJobAge; the mark still says it
        return "scancel, with requeue turned off first"

    def log_path(self, record, rank: int, stream: str) -> Path:
        return RunPaths(Path(record.run_dir)).rank_log(record.job_id, rank, stream)

    # --- the optional capabilities: Slurm has them all ---------------------------------------------------------------

    def refusal(self, capability: str) -> Unsupported | None:
        return None

    def dry_run_array(self, array) -> Request:
        return arrayjob.dry_run_array(array)

    def submit_array(self, array, request: Request, each) -> str:
        return arrayjob.submit_array(array, request, each, accounting_known)

    def dependency(self, parent, kind: str) -> str:
        """sbatch's --dependency value: ``afterok:123``; only on another Slurm job."""
        if parent.scheduler != self.name:
            raise InputError(f"run {parent.run_id} ran locally ({parent.profile}); only a Slurm job can be waited for",
                             loc="--after")
        return f"{kind}:{parent.job_id}"

    def start_estimate(self, request: Request) -> str:
        """sbatch --test-only's answer (its stderr): backfill's guess of the start, from the jobs ahead."""
        return commands.sbatch_test_only(request.script, timeout=15)

    def submit_export(self, record, profile, out: Path, dtype: str, merge: bool):
        from .exportjob import submit_export

        return submit_export(record, profile, out, dtype, merge)

    def partition_size(self, partition: str | None) -> tuple[str, int] | None:
        return commands.partition_size(partition)


def _sacct_rows(records) -> list[commands.SacctRow] | None:
    """sacct's rows for these runs in one call; None without accounting (then squeue/scontrol or events)."""
    if not all(r.extra.get("accounting") is not False for r in records):
        return None
    try:
        return commands.sacct([r.job_id for r in records])
    except commands.SlurmCommandError as exc:
        if "accounting storage is disabled" not in exc.stderr.lower():
            raise
        return None


def _by_job(rows: list[commands.SacctRow]) -> dict[str, list[commands.SacctRow]]:
    by_id: dict[str, list[commands.SacctRow]] = {}
    rests: dict[str, list[commands.SacctRow]] = {}
    for row in rows:
        ids = row.task_ids
        # An array's record of the tasks that never started on their own ("7_[0-2]", which keeps that name
        # even after some were split off and cancelled) stands for a task only where it has no row of its own.
        for job_id in ids:
            (rests if "[" in row.array_id else by_id).setdefault(job_id, []).append(row)
    for job_id, rest in rests.items():
        by_id.setdefault(job_id, rest)
    return by_id


def attempts_from_sacct(rows: list[commands.SacctRow]) -> dict[str, tuple[AttemptTimes, ...]]:
    """Each job's runs, oldest first, as times (a row without Submit, from an older recording, has none)."""
    ts = commands.slurm_timestamp
    return {
        job_id: tuple(AttemptTimes(queued_at=ts(r.submit), eligible_at=ts(r.eligible), start=ts(r.start),
                                   end=ts(r.end), state=r.state.split()[0] if r.state else "UNKNOWN") for r in runs)
        for job_id, runs in _by_job(rows).items()
    }


def views_from_sacct(rows: list[commands.SacctRow]) -> dict[str, SchedView]:
    """sacct -D gives one row per run of a job, oldest first: the last is now, the others are restarts."""
    attempts = attempts_from_sacct(rows)
    return {
        job_id: SchedView(state=runs[-1].state, restarts=len(runs) - 1, nodes=runs[-1].nodes or None,
                          attempts=attempts[job_id])
        for job_id, runs in _by_job(rows).items()
    }


def views_from_squeue(jobs: dict[str, dict[str, str]]) -> dict[str, SchedView]:
    """squeue knows no restart count; the worker's own start events fill it in (status.build_report)."""
    return {
        job_id: SchedView(state=info["state"], reason=_slurm_value(info["reason"]), nodes=info["nodes"] or None)
        for job_id, info in jobs.items()
    }


def view_from_scontrol(info: dict[str, str]) -> SchedView:
    return SchedView(
        state=info.get("JobState", "UNKNOWN"),
        reason=_slurm_value(info.get("Reason")),
        restarts=int(info.get("Restarts", "0") or 0),
        nodes=_slurm_value(info.get("NodeList")),
    )


def _slurm_value(value: str | None) -> str | None:
    """Slurm's words for 'nothing' ("None", "(null)", "") as None."""
    return None if value in (None, "", "None", "(null)") else value


def accounting_known() -> bool | None:
    try:
        return commands.accounting_enabled()
    except Exception:  # status falls back to squeue/scontrol when unknown
        return None


BACKEND = SlurmBackend()
