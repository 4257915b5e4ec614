"""Status: the scheduler's view (sacct, or squeue/scontrol without accounting) joined with training progress."""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from fsdpjob.orchestrator.slurm import commands as slurm_cli
from fsdpjob.orchestrator.core.errors import FsdpjobError
from .progress import Progress, read_progress
from .registry import JobRecord

# Slurm job states -> fsdpjob phases (a plain table; UNKNOWN when absent).
PHASES = {
    "PENDING": "PENDING",
    "CONFIGURING": "RUNNING",
    "RUNNING": "RUNNING",
    "COMPLETING": "RUNNING",
    "SUSPENDED": "RUNNING",
    "STAGE_OUT": "RUNNING",
    "RESIZING": "RUNNING",
    "REQUEUED": "REQUEUED",
    "REQUEUE_HOLD": "REQUEUED",
    "REQUEUE_FED": "REQUEUED",
    "RESV_DEL_HOLD": "PENDING",
    "SPECIAL_EXIT": "FAILED",
    "PREEMPTED": "REQUEUED",  # with --requeue Slurm puts it back in the queue; see _phase for the terminal case
    "COMPLETED": "COMPLETED",
    "FAILED": "FAILED",
    "NODE_FAIL": "FAILED",
    "BOOT_FAIL": "FAILED",
    "OUT_OF_MEMORY": "FAILED",
    "DEADLINE": "FAILED",
    "CANCELLED": "CANCELLED",
    "TIMEOUT": "TIMEOUT",
}

STATUS_KEYS = (
    "run_id", "name", "job_id", "scheduler", "profile", "phase", "scheduler_state", "reason", "restarts",
    "step", "max_steps", "loss", "tokens_per_s", "last_checkpoint_step", "steps_lost", "eta_s", "nodes",
    "world_size", "run_dir", "submitted_at", "failure_reason", "last_stop",
)


@dataclass
class StatusReport:
    """One run's status. The JSON keys (STATUS_KEYS) are a stable interface."""

    run_id: str
    name: str
    job_id: str
    scheduler: str
    profile: str
    phase: str
    scheduler_state: str
    reason: str | None
    restarts: int
    step: int | None
    max_steps: int
    loss: float | None
    tokens_per_s: float | None
    last_checkpoint_step: int | None
    steps_lost: int
    eta_s: float | None
    nodes: str | None
    world_size: int
    run_dir: str
    submitted_at: float
    failure_reason: str | None
    # The newest stop checkpoint: {"reason": preemption|time_limit|requeue|cancelled|signal, "step", "requeued"}.
    last_stop: dict | None = None

    def to_json(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class SchedView:
    """What the scheduler says about one job."""

    state: str  # raw Slurm state word (first word of e.g. "CANCELLED by 0"), or local pseudo-state
    reason: str | None = None
    restarts: int = 0
    nodes: str | None = None


def phase_of(state: str, restarts: int, progress: Progress) -> str:
    word = state.split()[0] if state else "UNKNOWN"
    phase = PHASES.get(word, "UNKNOWN")
    if phase == "PENDING" and restarts > 0:
        return "REQUEUED"  # back in the queue after a preemption or time limit (BeginTime hold)
    if phase == "UNKNOWN":
        # Aged out of slurmctld (no accounting) or never seen: trust the worker's own events.
        if progress.done:
            return "COMPLETED"
        if progress.failure:
            return "FAILED"
    return phase


def slurm_views(records: list[JobRecord]) -> dict[str, SchedView]:
    """One scheduler call for all Slurm records (sacct with accounting, squeue without)."""
    ids = [r.job_id for r in records if r.scheduler == "slurm"]
    if not ids:
        return {}
    with_accounting = all(r.extra.get("accounting") is not False for r in records if r.scheduler == "slurm")
    if with_accounting:
        try:
            rows = slurm_cli.sacct(ids)
        except slurm_cli.SlurmCommandError as exc:
            if "accounting storage is disabled" not in exc.stderr.lower():
                raise
            rows = None
        if rows is not None:
            return views_from_sacct(rows)
    return views_from_squeue(slurm_cli.squeue(ids))


def views_from_sacct(rows: list[slurm_cli.SacctRow]) -> dict[str, SchedView]:
    """sacct -D gives one row per run of a job, oldest first: the last is now, the others are restarts."""
    by_id: dict[str, list[slurm_cli.SacctRow]] = {}
    for row in rows:
        by_id.setdefault(row.job_id, []).append(row)
    return {
        job_id: SchedView(state=runs[-1].state, restarts=len(runs) - 1, nodes=runs[-1].nodes or None)
        for job_id, runs in by_id.items()
    }


def views_from_squeue(jobs: dict[str, dict[str, str]]) -> dict[str, SchedView]:
    """squeue knows no restart count; the worker's own start events fill it in (build_report)."""
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


def local_controller_alive(record: JobRecord) -> bool:
    """Whether the run's submitit controller (pid = job id) still runs; a recycled pid does not count."""
    try:
        with open(f"/proc/{int(record.job_id)}/cmdline", "rb") as f:
            return b"submitit" in f.read()
    except OSError:
        return False


def local_view(record: JobRecord) -> SchedView:
    """A local run: the submitit controller process, then its result pickles."""
    pid = int(record.job_id)
    if local_controller_alive(record):
        return SchedView(state="RUNNING", nodes=os.uname().nodename)
    if record.extra.get("cancelled"):
        return SchedView(state="CANCELLED")
    results = sorted(Path(record.run_dir, "submitit").glob(f"{pid}_*_result.pkl"))
    if not results:
        return SchedView(state="FAILED", reason="worker processes exited without a result")
    import pickle

    try:
        with open(results[0], "rb") as f:
            outcome = pickle.load(f)[0]
    except Exception:  # noqa: BLE001 - an unreadable pickle is a failed run
        outcome = "error"
    return SchedView(state="COMPLETED" if outcome == "success" else "FAILED")


def build_report(record: JobRecord, view: SchedView | None) -> StatusReport:
    progress = read_progress(Path(record.run_dir))
    view = view or SchedView(state="UNKNOWN")
    restarts = max(view.restarts, progress.restarts)
    phase = phase_of(view.state, restarts, progress)
    if phase == "UNKNOWN" and record.extra.get("cancelled"):
        phase = "CANCELLED"  # fsdpjob cancel, and slurmctld (no accounting) has forgotten the job since
    failure = progress.failure if phase in ("FAILED", "CANCELLED", "TIMEOUT", "UNKNOWN") else None
    if phase == "FAILED" and not failure:
        failure = view.reason or f"scheduler state {view.state}"
    return StatusReport(
        run_id=record.run_id,
        name=record.name,
        job_id=record.job_id,
        scheduler=record.scheduler,
        profile=record.profile,
        phase=phase,
        scheduler_state=view.state,
        reason=view.reason,
        restarts=restarts,
        step=progress.step,
        max_steps=record.max_steps,
        loss=progress.loss,
        tokens_per_s=progress.tokens_per_s,
        last_checkpoint_step=progress.last_checkpoint_step,
        steps_lost=progress.steps_lost,
        eta_s=progress.eta_s if phase == "RUNNING" else None,
        nodes=view.nodes,
        world_size=record.world_size,
        run_dir=record.run_dir,
        submitted_at=record.submitted_at,
        failure_reason=failure,
        last_stop={k: progress.last_stop.get(k) for k in ("reason", "step", "requeued")} if progress.last_stop else None,
    )


def single_view(record: JobRecord) -> SchedView:
    """Status of one job: scontrol when slurmctld still knows it (restarts, reason), else sacct/squeue."""
    if record.scheduler == "local":
        return local_view(record)
    info = slurm_cli.scontrol_job(record.job_id)
    if info:
        return view_from_scontrol(info)
    return slurm_views([record]).get(record.job_id, SchedView(state="UNKNOWN"))


def reports(records: list[JobRecord]) -> list[StatusReport]:
    try:
        views = slurm_views(records)
    except FsdpjobError as exc:
        views = {}
        if any(r.scheduler == "slurm" for r in records):
            import sys

            print(f"fsdpjob: warning: scheduler not reachable ({exc}); showing training progress only", file=sys.stderr)
    out = []
    for r in records:
        view = local_view(r) if r.scheduler == "local" else views.get(r.job_id)
        out.append(build_report(r, view))
    return out


def format_eta(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return time.strftime("%H:%M:%S", time.gmtime(seconds)) if seconds < 86400 else f"{seconds / 86400:.1f}d"
