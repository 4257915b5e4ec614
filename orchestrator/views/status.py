"""Status: the scheduler's view (sacct, or squeue/scontrol without accounting) joined with training progress."""

from __future__ import annotations

import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from fsdpjob.orchestrator.backend import SchedView, backend_for
from fsdpjob.orchestrator.core.errors import FsdpjobError
from fsdpjob.orchestrator.core.runfolder import runlog
from fsdpjob.orchestrator.registry import JobRecord
from fsdpjob.orchestrator.views.goodput import goodput

from .chains import chain_state
from .lineage import resumed_from
from .progress import Progress, read_progress

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

DATA_KEYS = ("sequences", "examples", "truncated", "split", "dropped", "packing_efficiency")
STATUS_KEYS = (
    "run_id", "name", "job_id", "scheduler", "profile", "phase", "scheduler_state", "reason", "restarts",
    "step", "max_steps", "loss", "eval_loss", "tokens_per_s", "last_checkpoint_step", "steps_lost", "eta_s", "nodes",
    "world_size", "run_dir", "submitted_at", "failure_reason", "last_stop", "goodput", "recovery", "data",
    "resumed_from", "after", "reward",
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
    eval_loss: float | None
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
    # The goodput headline (core/goodput/account.py): goodput, ettr, allocated_unit_s, productive_unit_s
    # (unit-seconds:
    # GPU-seconds, or CPU rank-seconds), unit, units, source, interruptions (their count).
    goodput: dict | None = None
    # The in-allocation supervisor (orchestrator/supervise): restarts (in this allocation, beside `restarts`,
    # the requeues), faults, last_fault {kind: crash|hang|straggler, reason, ranks, hosts, top_frames, stacks,
    # decision}, excluded_nodes. None when it never had to act.
    recovery: dict | None = None
    # The training data as the worker packed it (its newest data event): DATA_KEYS; None before it was ready.
    data: dict | None = None
    # Lineage (views/lineage.py): {"path": the submit --resume-from, "run_id": the run that wrote it, or None}.
    resumed_from: dict | None = None
    # A chain (submit --after, orchestrator/cli/chain.py): {"run_id", "job_id", "kind": afterok|afterany, "state":
    # waiting|never|released, "message"}; None for a run that waits for no other.
    after: dict | None = None
    # grpo: the mean reward of the newest logged step (its completions' weighted reward); None for other methods.
    reward: float | None = None

    def to_json(self) -> dict:
        return asdict(self)


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


def build_report(record: JobRecord, view: SchedView | None, parent_phase: str | None = None) -> StatusReport:
    """``parent_phase``: a chained run's parent's phase, where the caller looked it up (report_for)."""
    progress = read_progress(Path(record.run_dir))
    view = view or SchedView(state="UNKNOWN")
    restarts = max(view.restarts, progress.restarts)
    phase = phase_of(view.state, restarts, progress)
    if phase == "UNKNOWN" and (progress.cancelled or record.extra.get("cancelled")):
        phase = "CANCELLED"  # fsdpjob cancel, and slurmctld (no accounting) has forgotten the job since
    failure = progress.failure if phase in ("FAILED", "CANCELLED", "TIMEOUT", "UNKNOWN") else None
    if phase == "FAILED" and not failure:
        failure = view.reason or f"scheduler state {view.state}"
    after = None
    if record.extra.get("after"):
        after = chain_state(record.extra["after"], view.state, view.reason, bool(progress.events), parent_phase)
        if after["state"] == "never":
            failure = after["message"]
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
        eval_loss=progress.eval_loss,
        reward=progress.reward,
        tokens_per_s=progress.tokens_per_s,
        last_checkpoint_step=progress.last_checkpoint_step,
        steps_lost=progress.steps_lost,
        eta_s=progress.eta_s if phase == "RUNNING" else None,
        nodes=view.nodes or _host_from_events(record, progress.events),
        world_size=record.world_size,
        run_dir=record.run_dir,
        submitted_at=record.submitted_at,
        failure_reason=failure,
        last_stop=({k: progress.last_stop.get(k) for k in ("reason", "step", "requeued")}
                   if progress.last_stop else None),
        goodput=_goodput(record, view, progress, phase),
        recovery=progress.recovery(),
        data={k: progress.data.get(k) for k in DATA_KEYS} if progress.data else None,
        resumed_from=resumed_from(record),
        after=after,
    )


def _host_from_events(record: JobRecord, events: list[dict]) -> str | None:
    """The machine a local run ran on, from its last start event (its controller's view names it only while it
    runs); a Slurm job's nodes come from Slurm alone (rank 0's host is one node of several)."""
    if not backend_for(record.scheduler).host_from_events:
        return None
    starts = [e for e in events if e.get("event") == runlog.START and e.get("host")]
    return str(starts[-1]["host"]) if starts else None


def _goodput(record: JobRecord, view: SchedView, progress: Progress, phase: str) -> dict | None:
    """From the run log's tails status reads anyway, and the attempts' times where the scheduler gave them;
    `fsdpjob report` reads everything."""
    if not progress.events:
        return None
    live = phase in ("PENDING", "RUNNING", "REQUEUED")
    g = goodput(record, list(view.attempts) if view.attempts else None, progress.events, progress.metrics,
                now=time.time() if live else None)
    return {"goodput": g.goodput, "ettr": g.ettr, "allocated_unit_s": g.allocated_unit_s,
            "productive_unit_s": g.productive_unit_s,
            "unit": g.unit, "units": g.units, "source": g.source, "interruptions": len(g.interruptions)}


def report_for(record: JobRecord) -> StatusReport:
    """One run's status, from the freshest scheduler view its backend can give, and the attempts' times for
    its goodput (one sacct call where accounting runs: without them the time before each start event and
    after each attempt's last event would be missing from the allocated time)."""
    backend = backend_for(record.scheduler)
    view = backend.view(record)
    if view.attempts is None:
        try:
            view = replace(view, attempts=tuple(backend.attempts(record) or ()) or None)
        except FsdpjobError:
            pass  # the goodput then comes from the run's events
    return build_report(record, view, _parent_phase(record, view))


def _parent_phase(record: JobRecord, view: SchedView) -> str | None:
    """A chained run's parent's phase, looked up only while the child has not started (it says whether the child
    ever will); None for a run without a parent or one the registry or scheduler no longer knows."""
    after = record.extra.get("after")
    if not after or view.state.split()[0:1] not in (["PENDING"], ["CANCELLED"]):
        return None
    from fsdpjob.orchestrator import registry

    try:
        parent = registry.find(after["run_id"])
        parent_view = backend_for(parent.scheduler).view(parent)
    except FsdpjobError:
        return None
    return phase_of(parent_view.state, parent_view.restarts, read_progress(Path(parent.run_dir)))


def reports(records: list[JobRecord]) -> list[StatusReport]:
    """Every run's status with one scheduler call per backend."""
    by_kind: dict[str, list[JobRecord]] = {}
    for r in records:
        by_kind.setdefault(r.scheduler, []).append(r)
    views: dict[str, SchedView] = {}
    for kind, group in by_kind.items():
        try:
            views.update(backend_for(kind).views(group))
        except FsdpjobError as exc:
            print(f"fsdpjob: warning: scheduler not reachable ({exc}); showing training progress only", file=sys.stderr)
    return [build_report(r, views.get(r.job_id)) for r in records]


def format_eta(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return time.strftime("%H:%M:%S", time.gmtime(seconds)) if seconds < 86400 else f"{seconds / 86400:.1f}d"
