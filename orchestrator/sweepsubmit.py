"""`fsdpjob sweep`: every variant loaded, validated and planned first (one bad variant refuses the whole sweep,
named); then, on Slurm, one array job whose task i is run i (its own run folder and registry record), or on the
local profile the runs one after another. The side effects are here; the variants are orchestrator/sweep.py's
and the array script slurm/arrayrender.py's."""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from fsdpjob.orchestrator import registry
from fsdpjob.orchestrator import submit as submission
from fsdpjob.orchestrator.core.errors import FsdpjobError, InputError, PlanRefused, SubmissionError
from fsdpjob.orchestrator.core.fileio import write_atomic
from fsdpjob.orchestrator.core.paths import RunPaths, new_run_id, runs_root
from fsdpjob.orchestrator.core.sweepstate import SweepState, SweepTask
from fsdpjob.orchestrator.planner.jobload import LoadedJob, load_job
from fsdpjob.orchestrator.registry import JobRecord
from fsdpjob.orchestrator.sweep import SweepSpec, Variant, array_range


@dataclass(frozen=True)
class PlannedVariant:
    variant: Variant
    job: LoadedJob
    worker_facts: dict
    warnings: tuple[str, ...]


@dataclass(frozen=True)
class SweepPlan:
    name: str
    sweep_id: str
    scheduler: str
    max_parallel: int | None
    variants: tuple[PlannedVariant, ...]

    @property
    def array(self) -> str:
        return array_range(len(self.variants), self.max_parallel)


def label(v: Variant, count: int) -> str:
    return f"sweep variant {v.index} of {count} ({v.label()})"


def plan_sweep(spec: str, sweep: SweepSpec, *, profile: str | None, sets: tuple[str, ...], force: bool) -> SweepPlan:
    """Load and plan every variant before anything is written; the first bad one refuses the sweep (exit 2)."""
    from fsdpjob.orchestrator.core.spec import load_spec
    from fsdpjob.orchestrator.planner.fit import make_plan

    name = sweep.name or load_spec(spec, list(sets))[0].name[:56]
    count = len(sweep.variants)
    planned = []
    for v in sweep.variants:
        where = label(v, count)
        try:
            job = load_job(spec, profile=profile, overrides=(*sets, *v.sets, f"name={name}-{v.index}"))
            fit = make_plan(job)
        except InputError as exc:
            raise InputError(f"{where}: {exc.format()}") from None
        except FsdpjobError as exc:
            raise type(exc)(f"{where}: {exc}") from None
        if not force and fit.verdict != "FITS":
            why = fit.refusal if fit.verdict == "REFUSED" else "the planner says it does not fit (`fsdpjob plan` with its --set items)"
            raise PlanRefused(f"{where}: {why} (or pass --force)")
        planned.append(PlannedVariant(v, job, fit.worker_facts(), tuple(fit.warnings)))
    schedulers = {p.job.profile.name for p in planned}
    if len(schedulers) > 1:
        raise InputError(f"the variants run on {len(schedulers)} profiles ({', '.join(sorted(schedulers))}); a sweep "
                         "runs on one profile: sweep `profile` as separate sweeps", file="--grid")
    return SweepPlan(name=name, sweep_id=new_run_id(name), scheduler=planned[0].job.profile.scheduler,
                     max_parallel=sweep.max_parallel, variants=tuple(planned))


def task_paths(plan: SweepPlan) -> tuple[Path, list[RunPaths]]:
    """The sweep's folder and its runs' folders inside it: run i is <name>-<i>-<the sweep's time and id>."""
    sweep_dir = runs_root() / plan.sweep_id
    suffix = plan.sweep_id[len(plan.name):]
    return sweep_dir, [RunPaths(sweep_dir / f"{plan.name}-{p.variant.index}{suffix}") for p in plan.variants]


def array_script(plan: SweepPlan, spec_source: str) -> str:
    """The array job's script (pure; refuses a variant that changes the job's shape)."""
    from fsdpjob.orchestrator.slurm.arrayrender import PLACEHOLDER, ArrayTask, array_plan
    from fsdpjob.orchestrator.slurm.render import build_plan, render_script

    sweep_dir, paths = task_paths(plan)
    count = len(plan.variants)
    tasks = [ArrayTask(run_dir=str(rp.run_dir), label=label(p.variant, count),
                       plan=build_plan(p.job, RunPaths(Path(PLACEHOLDER)), spec_source=spec_source))
             for p, rp in zip(plan.variants, paths)]
    return render_script(array_plan(tasks, name=plan.name, sweep_id=plan.sweep_id, sweep_dir=str(sweep_dir),
                                     array=plan.array, spec_source=spec_source))


def _sweep_facts(plan: SweepPlan, v: Variant, array_job: str | None) -> dict:
    return {"id": plan.sweep_id, "name": plan.name, "index": v.index, "count": len(plan.variants),
            "values": v.values, "job_id": array_job}


def submit_array(plan: SweepPlan, spec_source: str) -> list[JobRecord]:
    """One sbatch for the whole sweep; a record per task (job id <array job>_<index>). On failure nothing stays."""
    from fsdpjob.jobs.entry import TrainJob
    from fsdpjob.orchestrator.slurm.backend import accounting_known
    from fsdpjob.orchestrator.slurm.executor import FsdpjobArrayExecutor

    script = array_script(plan, spec_source)  # refusals come before any folder is made
    sweep_dir, paths = task_paths(plan)
    first = plan.variants[0].job
    env = {k: first.spec.env[k] for k in first.spec.secret_names()}  # as a single run's: secrets travel here only
    with submission.owner_only():
        sweep_dir.mkdir(parents=True, mode=0o700)
        try:
            for p, rp in zip(plan.variants, paths):
                rp.run_dir.mkdir(mode=0o700)
                submission.write_run_folder(p.job, rp, script, None, p.worker_facts)
            write_atomic(sweep_dir / "job.sbatch", script, mode=0o700)
            (sweep_dir / "submitit").mkdir(mode=0o700)
            executor = FsdpjobArrayExecutor(sweep_dir / "submitit", script=script)
            executor.update_parameters(time=max(1, first.eff.time_limit_s // 60), signal_delay_s=first.eff.signal_lead_s)
            with submission.job_environment(env):
                array_job = executor.submit_array([(rp.submitit_dir, TrainJob(str(rp.run_dir))) for rp in paths])
        except Exception as exc:  # noqa: BLE001 - whatever sbatch says, in one line, and nothing left behind
            shutil.rmtree(sweep_dir, ignore_errors=True)
            if isinstance(exc, FsdpjobError):
                raise
            raise SubmissionError(f"sweep submission failed, nothing was recorded: {submission.sbatch_reason(exc)}") from None
        accounting = accounting_known()
        records = []
        for p, rp in zip(plan.variants, paths):
            job = p.job
            record = JobRecord(
                run_id=rp.run_id, name=job.spec.name, run_dir=str(rp.run_dir), scheduler="slurm",
                job_id=f"{array_job}_{p.variant.index}", profile=job.profile.name, submitted_at=time.time(),
                spec_hash=job.spec.spec_hash(), nodes=job.eff.nodes, tasks_per_node=job.eff.tasks_per_node,
                gpus_per_node=job.eff.gpus_per_node, max_steps=job.spec.train.max_steps,
                slurm_conf=_slurm_conf(), extra={"accounting": accounting},
                sweep=_sweep_facts(plan, p.variant, array_job),
            )
            registry.save(record)
            records.append(record)
        SweepState(id=plan.sweep_id, name=plan.name, job_id=array_job, array=plan.array,
                   runs=tuple(SweepTask(r.sweep["index"], r.run_id, r.sweep["values"]) for r in records)).write(sweep_dir)
    return records


def _slurm_conf() -> str | None:
    import os

    return os.environ.get("SLURM_CONF")


def run_locally(plan: SweepPlan, on_submitted) -> list[JobRecord]:
    """The local profile: the variants one after another (this machine's cores go to one run at a time), each a
    run of its own; ``on_submitted(record)`` follows each (it waits for the run's end)."""
    records = []
    for p in plan.variants:
        sub = submission.submit(p.job, worker_facts=p.worker_facts)
        sub.record.sweep = _sweep_facts(plan, p.variant, None)
        registry.save(sub.record)
        records.append(sub.record)
        on_submitted(sub.record)
    return records
