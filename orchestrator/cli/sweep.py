"""`fsdpjob sweep`: the variants (sweeps/spec.py), each checked and planned (sweeps/submit.py), then the dry run or the
job array through the backend; runs that are this terminal's (the local profile) are followed one by one."""

from __future__ import annotations

from pathlib import Path

import click

from .options import JSON_OPT, NO_FILE_CHECKS_OPT, PROFILE_OPT, SET_OPT, SPEC_ARG, command, echo_json


@command()
@SPEC_ARG
@click.option(
    "--grid",
    "grids",
    multiple=True,
    metavar="KEY=V1,V2,...",
    help="Sweep a spec field over these values (YAML values, as --set); several --grid make a grid.",
)
@click.option(
    "--sweep",
    "sweep_file",
    type=click.Path(dir_okay=False, path_type=Path),
    help="A file with a `sweep:` section: grid, variants (lists of --set items), name, max_parallel.",
)
@click.option(
    "--max-parallel", type=click.IntRange(min=1), metavar="N", help="At most N runs at once (Slurm: --array=0-K%N)."
)
@click.option("--name", help="The sweep's name; run i is NAME-i [default: the spec's name].")
@PROFILE_OPT
@SET_OPT
@click.option(
    "--dry-run", is_flag=True, help="Validate and plan every variant, print the array script; submit nothing."
)
@click.option("--force", is_flag=True, help="Submit even if the planner says a variant cannot fit.")
@NO_FILE_CHECKS_OPT
@JSON_OPT
def sweep(spec, grids, sweep_file, max_parallel, name, profile, sets, dry_run, force, no_file_checks, as_json) -> None:
    """Run variants of a spec (a grid of values, or a list of --set variants) as one Slurm array job, each a run
    of its own; on the local profile one after another. Every variant is checked before anything is submitted."""
    from fsdpjob.orchestrator import submit as submission
    from fsdpjob.orchestrator.cli.sweeps.spec import make_sweep

    from .sweeps import submit as sweepsubmit

    if no_file_checks and not dry_run:  # as submit's: a real sweep checks the files first
        raise click.UsageError("--no-file-checks goes with --dry-run only: a real sweep checks the files first")
    wanted = make_sweep(grids, sweep_file=sweep_file, name=name, max_parallel=max_parallel)
    plan = sweepsubmit.plan_sweep(spec, wanted, profile=profile, sets=sets, force=force,
                                  check_files=not no_file_checks)
    array = sweepsubmit.array_request(plan, spec)
    request = submission.dry_run_array(array)  # refuses a variant that changes the shape of one array job
    if dry_run:
        print_dry_run(plan, request, as_json)
        return
    warn(plan, request)
    from fsdpjob.orchestrator.backend import backend_for

    if backend_for(plan.scheduler).foreground:
        follow_each(plan, array, request)  # exits with the runs' status
        return
    records = sweepsubmit.submit_sweep(array, request)
    print_submitted(plan, request, records, as_json)


def print_dry_run(plan, request, as_json: bool) -> None:
    if as_json:
        echo_json({
            "sweep": plan.sweep_id,
            "name": plan.name,
            "array": request.array,
            "variants": [{"index": p.variant.index, "name": p.job.spec.name, "sets": list(p.variant.sets)}
                         for p in plan.variants],
            "script": request.script,
        })
        return
    for p in plan.variants:
        click.echo(f"variant {p.variant.index}: {p.job.spec.name}: {p.variant.label()}", err=True)
    click.echo(request.text, nl=False)


def warn(plan, request) -> None:
    """The planner's warnings once each, naming the variants they are about, then the backend's notes."""
    warned: dict[str, list[str]] = {}
    for p in plan.variants:
        for warning in p.warnings:
            warned.setdefault(warning, []).append(str(p.variant.index))
    for warning, which in warned.items():
        whom = "every variant" if len(which) == len(plan.variants) else f"variant {', '.join(which)}"
        click.echo(f"warning: {whom}: {warning}", err=True)
    for note in request.notes:
        click.echo(f"warning: {note}", err=True)


def follow_each(plan, array, request) -> None:
    """The runs are this terminal's: each followed to its end before the next starts; exit 1 if any failed."""
    from fsdpjob.orchestrator.views.follow import wait_for

    from .sweeps import submit as sweepsubmit

    results: list[int] = []

    def follow(record) -> None:
        click.echo(f"sweep {plan.name}: run {record.sweep['index'] + 1} of {len(plan.variants)}: {record.run_id}")
        results.append(wait_for(record))

    sweepsubmit.submit_sweep(array, request, follow)
    raise SystemExit(1 if any(results) else 0)


def print_submitted(plan, request, records, as_json: bool) -> None:
    array_job = records[0].sweep["job_id"]
    if as_json:
        echo_json({
            "sweep": plan.sweep_id,
            "name": plan.name,
            "job_id": array_job,
            "runs": [{"index": r.sweep["index"], "run_id": r.run_id, "job_id": r.job_id, "run_dir": r.run_dir}
                     for r in records],
        })
        return
    click.echo(f"submitted sweep {plan.name} ({plan.sweep_id}): array job {array_job} (--array={request.array}), "
               f"{len(records)} runs")
    for r in records:
        values = " ".join(f"{k}={v}" for k, v in r.sweep["values"].items())
        click.echo(f"  {r.sweep['index']}: {r.run_id} (job {r.job_id}): {values}")
