"""The scheduler interface (in the shape of TorchX's schedulers): a pure dry run that returns the request,
submit, the scheduler's view of many runs in one call, the times of a run's attempts, cancel, and log paths. Two backends implement it,
orchestrator/slurm/backend.py and orchestrator/local/backend.py; nothing else branches on the scheduler."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from fsdpjob.orchestrator.core.paths import RunPaths

if TYPE_CHECKING:
    from fsdpjob.orchestrator.planner.jobload import LoadedJob
    from fsdpjob.orchestrator.registry import JobRecord


@dataclass(frozen=True)
class Request:
    """What a submit would send, decided without side effects (the dry run)."""

    paths: RunPaths
    text: str  # what `render` and `submit --dry-run` print: the sbatch script, or what starts locally
    script: str | None  # the batch script to keep in the run folder, if the scheduler takes one
    env: dict[str, str]  # environment of the submission call (secrets travel here, never through a file)
    payload: object = None  # backend-specific (the Slurm backend's SbatchPlan)
    files: tuple[tuple[str, str], ...] = ()  # (path in the run folder, text) written beside the script


@dataclass(frozen=True)
class Submitted:
    job_id: str
    record_fields: dict = field(default_factory=dict)  # scheduler facts the registry keeps (slurm_conf, extra)


@dataclass(frozen=True)
class AttemptTimes:
    """One run of a job as the scheduler accounted it (Unix seconds; None: not yet, or not known)."""

    queued_at: float | None  # submitted, or requeued (a restart's queue time starts at its requeue)
    eligible_at: float | None  # could start from then on (after a requeue: the end of the BeginTime hold)
    start: float | None  # allocation start
    end: float | None  # allocation end; None while it runs
    state: str  # how this run ended (REQUEUED, PREEMPTED, TIMEOUT, COMPLETED...) or its state now


@dataclass(frozen=True)
class SchedView:
    """What the scheduler says about one job."""

    state: str  # raw scheduler state word (first word of e.g. "CANCELLED by 0"), or a local pseudo-state
    reason: str | None = None
    restarts: int = 0
    nodes: str | None = None
    attempts: tuple[AttemptTimes, ...] | None = None  # when the same call gave them (sacct), oldest first


class Backend(Protocol):
    name: str
    account: str  # what its attempts' times come from, as reports name it (a goodput report's "source")

    def dry_run(self, job: LoadedJob, paths: RunPaths) -> Request:
        """Pure: the request a submit of ``job`` into ``paths`` would send."""

    def submit(self, job: LoadedJob, request: Request) -> Submitted:
        """Hand the request to the scheduler; the run folder is already written."""

    def views(self, records: list[JobRecord]) -> dict[str, SchedView]:
        """The scheduler's view of many runs (job id -> view) with as few scheduler calls as it can."""

    def view(self, record: JobRecord) -> SchedView:
        """The freshest view of one run (may cost a call that views() avoids)."""

    def attempts(self, record: JobRecord) -> list[AttemptTimes] | None:
        """Every run of the job as the scheduler accounted it, oldest first; None where it keeps no such
        account (no accounting, or a local run): the run's own events then stand in."""

    def cancel(self, record: JobRecord, *, mark: Callable[[], None]) -> str:
        """Stop the run for good (no requeue, no restart); call ``mark`` (records the cancel) once the
        cancel is sure to happen and before the run's own view could need it. Returns how it stopped."""

    def log_path(self, record: JobRecord, rank: int, stream: str) -> Path:
        """Where rank ``rank`` writes its stdout ("out") or stderr ("err")."""


# Scheduler kind (a profile's `scheduler`, a record's `scheduler`) -> the module holding its BACKEND.
_MODULES = {"slurm": "fsdpjob.orchestrator.slurm.backend", "local": "fsdpjob.orchestrator.local.backend"}


def backend_for(kind: str) -> Backend:
    """The backend of a scheduler kind; imported on first use (the Slurm one pulls in submitit)."""
    return importlib.import_module(_MODULES[kind]).BACKEND
