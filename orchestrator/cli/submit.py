"""`fsdpjob submit`: load and check the job, plan it, then print the dry run, or submit it (and follow it with
--wait). The side effects are orchestrator/submit.py's; a chain's --after is chain.py's."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import click

from .options import (
    AFTER_OPT,
    JSON_OPT,
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
@SPEC_ARG
@PROFILE_OPT
@SET_OPT
@click.option("--dry-run", is_flag=True, help="Print the plan and the request; touch nothing; exit as submit would.")
@click.option("--wait", is_flag=True, help="Stream progress until the job ends; exit with its status.")
@click.option("--force", is_flag=True, help="Submit even if the planner says the job cannot fit.")
@click.option(
    "--resume-from",
    type=click.Path(exists=True, path_type=str),
    help="Start from this checkpoint (a step-N folder, a checkpoints folder or a run folder).",
)
@click.option(
    "--run-dir",
    type=click.Path(file_okay=False, path_type=Path),
    help="Run folder (default: $FSDPJOB_HOME/runs/<name>-<time>-<id>).",
)
@click.option(
    "--no-file-checks",
    is_flag=True,
    help="With --dry-run: skip checks of the model folder and data file (the plan still reads config.json).",
)
@click.option("--no-image-check", is_flag=True,
              help="Skip the container preflight (fsdpjob check-image), which runs once per image otherwise.")
@AFTER_OPT
@SHAPES_OPT
@JSON_OPT
def submit(
    spec, profile, sets, dry_run, wait, force, resume_from, run_dir, no_file_checks, no_image_check, after, shapes,
    as_json
) -> None:
    """Validate, plan, and submit a job (Slurm through submitit, or local processes with --profile local)."""
    from fsdpjob.orchestrator.core.errors import InputError
    from fsdpjob.orchestrator.core.runfolder.ckptlayout import pseudo_file_system
    from fsdpjob.orchestrator.planner.fit import make_plan
    from fsdpjob.orchestrator.planner.jobload import load_job

    if no_file_checks and not dry_run:
        raise click.UsageError("--no-file-checks goes with --dry-run only: a real submit checks the files first")
    if shapes and not dry_run:
        raise click.UsageError("--shapes goes with --dry-run (or plan): it compares start estimates, submits nothing")
    run_dir = run_dir.resolve() if run_dir else None
    if run_dir is not None and (pseudo := pseudo_file_system(run_dir)):  # root may "write" there: refused first
        raise InputError(f"{run_dir} is under {pseudo}, a kernel pseudo file system where no files can be kept; "
                         "pick a folder on a file system the nodes share", file="--run-dir")
    job = load_job(spec, profile=profile, overrides=sets, check_files=not no_file_checks, check_env=True,
                   resume_from=resume_from, ask_partition_size=partition_size)
    dependency = None
    if after is not None:  # an empty --after is refused (chain.py), not dropped
        from .chain import resolve_after

        dependency = resolve_after(after, job.profile.scheduler)
        job = replace(job, dependency=dependency.directive)
    fit = make_plan(job)
    if dry_run:
        print_dry_run(job, fit, run_dir, spec=spec, profile=profile, sets=sets, shapes=shapes, as_json=as_json)
        if no := refusal(fit, spec, force=force):
            raise no
        return
    record = submit_checked(job, fit, spec, force=force, run_dir=run_dir, resume_from=resume_from,
                            dependency=dependency, as_json=as_json, no_image_check=no_image_check)
    if wait:
        follow(record)


def print_dry_run(job, fit, run_dir: Path | None, *, spec: str, profile, sets, shapes, as_json: bool) -> None:
    """The plan, the start estimates and what would be submitted (the request: on stdout, the rest on stderr)."""
    from fsdpjob.orchestrator import submit as submission
    from fsdpjob.orchestrator.backend import dry_run
    from fsdpjob.orchestrator.views.plan import format_plan

    from .estimate import echo_estimates, start_estimates_for

    request = dry_run(job, run_dir)
    estimates = start_estimates_for(job, fit, spec, profile, sets, shapes)
    if as_json:
        echo_json({**submission.request_json(job, request, fit.to_json()), "start_estimates": estimates})
        return
    click.echo(format_plan(fit), err=True)
    echo_estimates(estimates, err=True)
    click.echo(request.text, nl=False)


def submit_checked(job, fit, spec: str, *, force: bool, run_dir, resume_from, dependency, as_json: bool,
                   no_image_check: bool = False):
    """Submit unless the plan refuses (the plan printed when it does not fit); say what was submitted."""
    from fsdpjob.orchestrator import submit as submission
    from fsdpjob.orchestrator.views.plan import format_plan

    if no := refusal(fit, spec, force=force):
        if fit.verdict == "DOES NOT FIT":
            click.echo(format_plan(fit), err=True)
        raise no
    for warning in fit.warnings:
        click.echo(f"warning: {warning}", err=True)
    if job.container is not None and not no_image_check:
        from fsdpjob.orchestrator.slurm.imagecheck import submit_gate

        if note := submit_gate(job.container.container, job.profile, echo=lambda line: click.echo(line, err=True)):
            click.echo(f"warning: {note}", err=True)
    record = submission.submit(job, run_dir=run_dir, resume_from=resume_from, worker_facts=fit.worker_facts(),
                               extra={"after": dependency.to_json()} if dependency else None).record
    if as_json:
        echo_json({"run_id": record.run_id, "job_id": record.job_id, "run_dir": record.run_dir})
    else:
        click.echo(
            f"submitted {record.run_id} (job {record.job_id}, {job.profile.name}); run folder {record.run_dir}"
            + (f"; starts after {dependency.run_id} (job {dependency.job_id}, {dependency.kind})" if dependency else "")
        )
    return record


def follow(record) -> None:
    """--wait: the run's progress until it ends; exit with its status. Ctrl-C detaches from a run that goes on
    without this command (`fsdpjob wait` re-attaches) and stops one that is this terminal's, as `fsdpjob cancel`
    does (a stop checkpoint, a cancelled stop), not by the SIGINT, which its own session keeps from the workers."""
    from fsdpjob.orchestrator.backend import backend_for
    from fsdpjob.orchestrator.submit import cancel as cancel_run
    from fsdpjob.orchestrator.views.follow import wait_for

    try:
        raise SystemExit(wait_for(record))
    except KeyboardInterrupt:
        if not backend_for(record.scheduler).foreground:
            raise
        click.echo(f"cancelling {record.run_id}: {cancel_run(record)}", err=True)
        raise SystemExit(130) from None
