"""The scheduler interface (in the shape of TorchX's schedulers): a pure dry run that returns the request,
submit, the scheduler's view of many runs in one call, the times of a run's attempts, cancel, and log paths; and
the optional capabilities some features ask for (job arrays for sweeps, chains, start estimates, the export job,
the partition's size). Two backends implement it, orchestrator/slurm/backend.py and orchestrator/local/backend.py;
a backend that cannot do an optional one raises ``Unsupported`` in its own words (as torchx's "does not support"
defaults), so nothing else branches on the scheduler."""

from __future__ import annotations

import contextlib
import importlib
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from fsdpjob.orchestrator.core.errors import InputError
from fsdpjob.orchestrator.core.runfolder.attempts import AttemptTimes  # the scheduler's account of one attempt
from fsdpjob.orchestrator.core.runfolder.paths import RunPaths, new_run_id, runs_root

if TYPE_CHECKING:
    from fsdpjob.orchestrator.core.jobspec.profiles import ClusterProfile
    from fsdpjob.orchestrator.planner.jobload import LoadedJob
    from fsdpjob.orchestrator.registry import JobRecord

# The optional capabilities a backend may refuse, as Unsupported names them (every backend has job arrays: the
# local one runs the tasks one after another).
CHAINS = "chains"
START_ESTIMATES = "start estimates"
EXPORT_JOBS = "export jobs"


class Unsupported(InputError):
    """A backend refusing an optional capability: the one wording of every such refusal (exit 2). ``hint`` is the
    backend's own: why, and what to do instead."""

    def __init__(self, backend: str, capability: str, hint: str, *, loc: str | None = None):
        self.backend, self.capability, self.hint = backend, capability, hint
        super().__init__(f"the {backend} scheduler does not support {capability}: {hint}", loc=loc)

    def for_option(self, option: str) -> Unsupported:
        """The same refusal, named after the option that asked for it."""
        return Unsupported(self.backend, self.capability, self.hint, loc=option)


@dataclass(frozen=True)
class Request:
    """What a submit would send, decided without side effects (the dry run)."""

    paths: RunPaths
    text: str  # what `render` and `submit --dry-run` print: the sbatch script, or what starts locally
    script: str | None  # the batch script to keep in the run folder, if the scheduler takes one
    env: dict[str, str]  # environment of the submission call (secrets travel here, never through a file)
    payload: object = None  # backend-specific (the Slurm backend's SbatchParts)
    files: tuple[tuple[str, str], ...] = ()  # (path in the run folder, text) written beside the script
    array: str | None = None  # a job array's task range as the scheduler takes it (Slurm's --array=0-K%N)
    notes: tuple[str, ...] = ()  # what the user should know before it is submitted (printed as warnings)


@dataclass(frozen=True)
class Submitted:
    job_id: str
    record_fields: dict = field(default_factory=dict)  # scheduler facts the registry keeps (slurm_conf, extra)
    array_id: str | None = None  # the job array this task is one of, where the scheduler made one


@dataclass(frozen=True)
class SchedView:
    """What the scheduler says about one job."""

    state: str  # raw scheduler state word (first word of e.g. "CANCELLED by 0"), or a local pseudo-state
    reason: str | None = None
    restarts: int = 0
    nodes: str | None = None
    attempts: tuple[AttemptTimes, ...] | None = None  # when the same call gave them (sacct), oldest first


@dataclass(frozen=True)
class ArrayMember:
    """One task of a job array (a sweep's variant): its job, its own run folder, how errors name it."""

    job: LoadedJob
    paths: RunPaths
    label: str
    worker_facts: dict  # the planner's, for the workers (spec.json)
    sweep: dict  # its record's sweep facts (the array's job id is added once it has one)


@dataclass(frozen=True)
class ArrayRequest:
    """A job array: its tasks in index order, the folder above their run folders, at most ``max_parallel`` at once."""

    name: str
    array_id: str  # the sweep's id, the name of its folder
    folder: Path
    tasks: tuple[ArrayMember, ...]
    max_parallel: int | None
    spec_source: str


@dataclass(frozen=True)
class ExportJob:
    job_id: str
    after: str | None  # the training job it waits for
    script: Path
    log: str


class Backend(Protocol):
    name: str
    account: str  # what its attempts' times come from, as reports name it (a goodput report's "source")
    # Its runs are this terminal's (the local machine's): Ctrl-C in `submit --wait` stops the run, and an array's
    # tasks run one after another while the command follows each. Else a run goes on without the command.
    foreground: bool
    host_from_events: bool  # its view names no nodes once the run ended: the run's own start events do

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

    # --- optional capabilities: each raises Unsupported where the backend has none --------------------------------

    def refusal(self, capability: str) -> Unsupported | None:
        """Why this backend cannot do ``capability`` (raised by its verb), or None where it can: for a caller that
        must refuse before it does anything else (a chain before the registry is asked for the parent)."""

    def dry_run_array(self, array: ArrayRequest) -> Request:
        """Pure: what a submit of the array would send (refuses tasks one submission cannot hold)."""

    def submit_array(self, array: ArrayRequest, request: Request, each: Callable[[ArrayMember, Submitted], None],
                     ) -> str | None:
        """Hand the array over (its run folders are written); ``each(task, submitted)`` follows every task's
        hand-over, in index order (and records it). Returns the array's own job id (None where it has none)."""

    def dependency(self, parent: JobRecord, kind: str) -> str:
        """The request's dependency on ``parent`` (``kind``: afterok | afterany) in the scheduler's words."""

    def start_estimate(self, request: Request) -> str:
        """The scheduler's own guess of when ``request`` would start, as it printed it."""

    def submit_export(self, record: JobRecord, profile: ClusterProfile, out: Path, dtype: str, merge: bool,
                      ) -> ExportJob:
        """Export the run's newest checkpoint in a job of its own, after the run's job where it still runs."""

    def partition_size(self, partition: str | None) -> tuple[str, int] | None:
        """The partition and its node count as the scheduler says it; None where it cannot say."""


# Scheduler kind (a profile's `scheduler`, a record's `scheduler`) -> the module holding its BACKEND.
_MODULES = {"slurm": "fsdpjob.orchestrator.slurm.backend", "local": "fsdpjob.orchestrator.local.backend"}


@contextlib.contextmanager
def job_environment(env: dict[str, str]):
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


def backend_for(kind: str) -> Backend:
    """The backend of a scheduler kind; imported on first use (the Slurm one pulls in submitit)."""
    return importlib.import_module(_MODULES[kind]).BACKEND


def dry_run(job: LoadedJob, run_dir: Path | None = None) -> Request:
    """What would be submitted, touching nothing (here, not in submit.py: `fsdpjob render` then imports none of
    the registry and run-folder writers that a submit needs)."""
    return backend_for(job.profile.scheduler).dry_run(job, RunPaths(run_dir or runs_root() / new_run_id(job.spec.name)))
