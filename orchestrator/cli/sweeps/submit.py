"""`fsdpjob sweep`: every variant loaded, validated and planned first (one bad variant refuses the whole sweep,
named); then the variants as one job array through the backend (submit.submit_array: on Slurm one array job whose
task i is run i, on the local profile the runs one after another), each with its own run folder and registry
record. The variants are sweeps/spec.py's; the array is the backend's."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from fsdpjob.orchestrator import submit as submission
from fsdpjob.orchestrator.backend import ArrayMember, ArrayRequest, Request
from fsdpjob.orchestrator.core.errors import FsdpjobError, InputError, PlanRefused
from fsdpjob.orchestrator.core.runfolder.paths import RunPaths, new_run_id, runs_root
from fsdpjob.orchestrator.planner.jobload import LoadedJob, load_job
from fsdpjob.orchestrator.registry import JobRecord

from .spec import SweepSpec, Variant


@dataclass(frozen=True)
class PlannedVariant:
    variant: Variant
    job: LoadedJob
    worker_facts: dict
    warnings: tuple[str, ...]


@dataclass(frozen=True)
class CheckedSweep:
    name: str
    sweep_id: str
    scheduler: str
    max_parallel: int | None
    variants: tuple[PlannedVariant, ...]


def label(v: Variant, count: int) -> str:
    return f"sweep variant {v.index} of {count} ({v.label()})"


def plan_sweep(spec: str, sweep: SweepSpec, *, profile: str | None, sets: tuple[str, ...], force: bool,
               check_files: bool = True) -> CheckedSweep:
    """Load and plan every variant before anything is written; the first bad one refuses the sweep (exit 2).
    ``check_files`` False (--dry-run --no-file-checks): the model folder and data are not checked, the
    environment still is."""
    from fsdpjob.orchestrator.core.jobspec.spec import load_spec
    from fsdpjob.orchestrator.planner.fit import make_plan

    name = sweep.name or load_spec(spec, list(sets))[0].name[:56]
    count = len(sweep.variants)
    planned = []
    for v in sweep.variants:
        where = label(v, count)
        try:
            job = load_job(spec, profile=profile, overrides=(*sets, *v.sets, f"name={name}-{v.index}"),
                           check_files=check_files, check_env=True)
            fit = make_plan(job)
        except InputError as exc:  # each problem on its line, as validate prints them, naming the variant
            from fsdpjob.orchestrator.core.jobspec.validation import SpecErrors

            each = [InputError(f"{where}: {e.format()}") for e in (getattr(exc, "errors", None) or [exc])]
            raise (SpecErrors(each) if len(each) > 1 else each[0]) from None
        except FsdpjobError as exc:
            raise type(exc)(f"{where}: {exc}") from None
        if not force and fit.verdict != "FITS":
            why = (fit.refusal if fit.verdict == "REFUSED"
                   else "the planner says it does not fit (`fsdpjob plan` with its --set items)")
            raise PlanRefused(f"{where}: {why} (or pass --force)")
        planned.append(PlannedVariant(v, job, fit.worker_facts(), tuple(fit.warnings)))
    schedulers = {p.job.profile.name for p in planned}
    if len(schedulers) > 1:
        raise InputError(f"the variants run on {len(schedulers)} profiles ({', '.join(sorted(schedulers))}); a sweep "
                         "runs on one profile: sweep `profile` as separate sweeps", file="--grid")
    return CheckedSweep(name=name, sweep_id=new_run_id(name), scheduler=planned[0].job.profile.scheduler,
                     max_parallel=sweep.max_parallel, variants=tuple(planned))


def task_paths(plan: CheckedSweep) -> tuple[Path, list[RunPaths]]:
    """The sweep's folder and its runs' folders inside it: run i is <name>-<i>-<the sweep's time and id>."""
    sweep_dir = runs_root() / plan.sweep_id
    suffix = plan.sweep_id[len(plan.name):]
    return sweep_dir, [RunPaths(sweep_dir / f"{plan.name}-{p.variant.index}{suffix}") for p in plan.variants]


def array_request(plan: CheckedSweep, spec_source: str) -> ArrayRequest:
    """The sweep as a job array: task i is variant i, in its own run folder inside the sweep's."""
    sweep_dir, paths = task_paths(plan)
    count = len(plan.variants)
    tasks = tuple(ArrayMember(job=p.job, paths=rp, label=label(p.variant, count), worker_facts=p.worker_facts,
                              sweep=_sweep_facts(plan, p.variant))
                  for p, rp in zip(plan.variants, paths))
    return ArrayRequest(name=plan.name, array_id=plan.sweep_id, folder=sweep_dir, tasks=tasks,
                        max_parallel=plan.max_parallel, spec_source=spec_source)


def _sweep_facts(plan: CheckedSweep, v: Variant) -> dict:
    return {"id": plan.sweep_id, "name": plan.name, "index": v.index, "count": len(plan.variants), "values": v.values}


def submit_sweep(array: ArrayRequest, request: Request, on_submitted=None) -> list[JobRecord]:
    """The array through its backend (Slurm: one array job; local: the runs one after another, ``on_submitted``
    following each); submit_array writes the sweep's own file beside its runs' folders (what the batch side reads
    at its end) before the hand-over."""
    return submission.submit_array(array, on_submitted)
