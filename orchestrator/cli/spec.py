"""The commands that read a spec and touch nothing: validate, render, schema, profiles, plan and show."""

from __future__ import annotations

from pathlib import Path

import click

from fsdpjob.orchestrator.core.errors import FsdpjobError

from .options import (
    JSON_OPT,
    NO_FILE_CHECKS_OPT,
    PROFILE_OPT,
    SET_OPT,
    SHAPES_OPT,
    SPEC_ARG,
    command,
    echo_json,
    partition_size,
    refusal,
)


@command()
@click.argument("specs", nargs=-1, required=True, type=click.Path(dir_okay=False, path_type=str))
@PROFILE_OPT
@SET_OPT
@NO_FILE_CHECKS_OPT
def validate(specs: tuple[str, ...], profile: str | None, sets: tuple[str, ...], no_file_checks: bool) -> None:
    """Validate job specs (and their model folder and data file). Exit 2 on the first invalid one."""
    from fsdpjob.orchestrator.core.jobspec.validation import SpecErrors
    from fsdpjob.orchestrator.planner.jobload import load_job

    failed: list[FsdpjobError] = []
    for path in specs:
        try:
            job = load_job(path, profile=profile, overrides=sets, check_files=not no_file_checks,
                           check_env=True, ask_partition_size=partition_size)
        except FsdpjobError as exc:
            failed.append(exc)
            continue
        click.echo(
            f"{path}: ok (profile {job.profile.name}, world size {job.eff.world_size}, sha256:{job.spec.spec_hash()})"
        )
        if job.size_unknown:
            click.echo(f"warning: {path}: {job.size_unknown}", err=True)
        if not no_file_checks:
            from fsdpjob.orchestrator.core.inputs.dataformats import long_example_warnings

            for warning in long_example_warnings(job.spec.data, Path(job.spec.model.path)):
                click.echo(f"warning: {path}: {warning}", err=True)
    if failed:
        errors = [e for exc in failed for e in (exc.errors if isinstance(exc, SpecErrors) else [exc])]
        raise SpecErrors(errors) if len(errors) > 1 else failed[0]


@command()
@SPEC_ARG
@PROFILE_OPT
@SET_OPT
@click.option("--run-dir", type=click.Path(file_okay=False, path_type=Path), help="Run folder to render for.")
@NO_FILE_CHECKS_OPT
def render(spec: str, profile: str | None, sets: tuple[str, ...], run_dir: Path | None, no_file_checks: bool) -> None:
    """Print the exact sbatch script `fsdpjob submit` would submit (touches nothing)."""
    from fsdpjob.orchestrator.backend import dry_run
    from fsdpjob.orchestrator.planner.jobload import load_job

    job = load_job(spec, profile=profile, overrides=sets, check_files=not no_file_checks, check_env=True)
    click.echo(dry_run(job, run_dir.resolve() if run_dir else None).text, nl=False)


@command()
def schema() -> None:
    """Print the JSON Schema of job specs (for editors' YAML language servers)."""
    from fsdpjob.orchestrator.core.jobspec.spec import json_schema

    echo_json(json_schema())


PROFILE_COLUMNS = ["name", "scheduler", "partition", "GPUs/node", "GPU", "host RAM", "max time", "description"]


@command()
@JSON_OPT
def profiles(as_json: bool) -> None:
    """List the cluster profiles (shipped ones and those in $FSDPJOB_PROFILES)."""
    from fsdpjob.orchestrator.core.jobspec.profiles import available_profiles, load_profile

    rows = []
    for name, path in available_profiles().items():
        p = load_profile(str(path))
        rows.append({"name": name, "scheduler": p.scheduler, "partition": p.partition,
                     "gpus_per_node": p.gpus_per_node, "gpu_type": p.gpu_type, "gpu_memory_gb": p.gpu_memory_gb,
                     "host_ram_gb": p.host_ram_gb, "max_time": p.max_time, "description": p.description,
                     "path": str(path)})
    if as_json:
        echo_json(rows)
        return
    from fsdpjob.orchestrator.views.display import table

    click.echo(table(PROFILE_COLUMNS, [
        [r["name"], r["scheduler"], r["partition"] or "-", str(r["gpus_per_node"]), r["gpu_type"] or "-",
         f"{r['host_ram_gb']:g} GB", r["max_time"] or "-", r["description"]]
        for r in rows
    ]))


@command()
@SPEC_ARG
@PROFILE_OPT
@SET_OPT
@SHAPES_OPT
@JSON_OPT
def plan(spec: str, profile: str | None, sets: tuple[str, ...], shapes: str | None, as_json: bool) -> None:
    """Check before queueing that the job fits: GPU and host memory, checkpoint size and save time, signal lead.

    Needs only the model's config.json (plan before the download); validate and submit check the weights too."""
    from fsdpjob.orchestrator.planner.fit import make_plan
    from fsdpjob.orchestrator.planner.jobload import load_job
    from fsdpjob.orchestrator.views.plan import format_plan

    from .estimate import echo_estimates, start_estimates_for

    job = load_job(
        spec,
        profile=profile,
        overrides=sets,
        check_files="config",  # before the download: config.json
        ask_partition_size=partition_size,
    )
    result = make_plan(job)
    estimates = start_estimates_for(job, result, spec, profile, sets, shapes)
    if as_json:
        echo_json({**result.to_json(), **({"start_estimates": estimates} if estimates else {})})
    else:
        click.echo(format_plan(result))
        echo_estimates(estimates, err=True)  # stdout stays the plan, whose last line is the verdict
    if refusal(result, spec, force=False):
        raise SystemExit(2)


@command()
@SPEC_ARG
@PROFILE_OPT
@SET_OPT
@JSON_OPT
def show(spec: str, profile: str | None, sets: tuple[str, ...], as_json: bool) -> None:
    """Print the resolved spec: every default, the profile's values filled in, paths absolute (YAML or --json).

    Secrets are shown as <secret>; files are not checked (`fsdpjob validate` does that)."""
    import yaml

    from fsdpjob.orchestrator.planner.jobload import load_job
    from fsdpjob.orchestrator.planner.resolve import resolved_spec

    data = resolved_spec(load_job(spec, profile=profile, overrides=sets, check_files=False))
    if as_json:
        echo_json(data)
    else:
        click.echo(yaml.safe_dump(data, sort_keys=False, allow_unicode=True), nl=False)
