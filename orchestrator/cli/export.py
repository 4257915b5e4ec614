"""`fsdpjob export`: a Hugging Face folder from a run, a checkpoint folder or a sweep's best run; or, with --submit,
the export as a job of its own after the run's job (the backend's export job, where it has one)."""

from __future__ import annotations

from pathlib import Path

import click

from fsdpjob.orchestrator.core.errors import FsdpjobError, InputError

from .options import PROFILE_OPT, command


@command()
@click.argument("source")
@click.option("--out", required=True, type=click.Path(file_okay=False, path_type=Path), help="Output folder.")
@click.option("--dtype", type=click.Choice(["bf16", "fp32"]), default="bf16", show_default=True)
@click.option(
    "--merge",
    is_flag=True,
    help="LoRA runs: merge the adapters into the base model (default: the peft adapter folder).",
)
@click.option(
    "--best", is_flag=True, help="SOURCE is a sweep: export its best variant's (lowest eval loss) best checkpoint."
)
@click.option(
    "--submit",
    "as_job",
    is_flag=True,
    help="Export in a CPU batch job that starts once the run's "
    "training job completes (afterok), on --profile's partition.",
)
@PROFILE_OPT
def export(source: str, out: Path, dtype: str, merge: bool, as_job: bool, profile: str | None, best: bool) -> None:
    """Write a Hugging Face folder (sharded safetensors) from a run (its id, or its folder: the newest committed
    checkpoint) or a checkpoint folder; for a LoRA run, a peft adapter folder, or with --merge the merged model."""
    if Path(source).is_file():  # a run is a folder or an id: said at once, before torch's import
        what = " (a job spec?)" if Path(source).suffix in (".yaml", ".yml") else ""
        raise InputError(f"{source} is a file{what}; export takes a run: its id (`fsdpjob list`), its run folder "
                         "or a checkpoint folder, e.g. `fsdpjob export RUN_ID --out my-model`", file="SOURCE")
    if as_job and best:
        raise click.UsageError(
            "--best goes without --submit: export the sweep's best run with `fsdpjob export RUN "
            "--submit` once the sweep has finished"
        )
    if as_job:
        export_job(source, out, dtype, merge, profile)
        return
    if profile:
        raise click.UsageError("--profile goes with --submit (the profile of the export job)")
    from fsdpjob.jobs.entry import ExportFailed, export_model

    path = Path(source)
    if best:
        from fsdpjob.orchestrator import registry
        from fsdpjob.orchestrator.views import sweepview

        tasks = registry.sweep_records(source)
        if not tasks:
            raise InputError(
                f"{source!r} is no sweep in the registry; give a sweep's name, id or array job id "
                "(`fsdpjob list`), or drop --best",
                file="SOURCE",
            )
        rows = sweepview.sweep_report(tasks)
        path, why = sweepview.best_checkpoint(rows[0])
        click.echo(f"best of sweep {source}: {rows[0].run_id} ({rows[0].values}): {why}", err=True)
    elif not path.exists():  # not a folder: a run of the registry (id, unique prefix, job id or name)
        from fsdpjob.orchestrator import registry
        from fsdpjob.orchestrator.core.errors import RunNotFound

        try:
            path = Path(registry.find(source).run_dir)
        except RunNotFound:
            raise RunNotFound(
                f"SOURCE: {source!r} is neither a folder nor a run in the registry; give a run id "
                "(`fsdpjob list`), a run folder or a checkpoint folder"
            ) from None
    try:
        written = export_model(path, out, dtype, merge=merge)
    except ExportFailed as exc:
        raise FsdpjobError(f"cannot export {source}: {exc}") from None
    click.echo(f"exported {written} -> {out}")


def export_job(source: str, out: Path, dtype: str, merge: bool, profile: str | None) -> None:
    """--submit: the export as a job of its own on ``profile`` (its backend's export job), after the run's job."""
    from fsdpjob.orchestrator import registry
    from fsdpjob.orchestrator.backend import EXPORT_JOBS, backend_for
    from fsdpjob.orchestrator.core.jobspec.profiles import load_profile

    if not profile:
        raise click.UsageError("--submit needs --profile/-p: the Slurm profile (partition) the export job runs on")
    chosen = load_profile(profile)
    backend = backend_for(chosen.scheduler)
    if refused := backend.refusal(EXPORT_JOBS):
        raise refused.for_option("--submit")
    record = registry.find(source)  # a run of the registry: its job is what the export waits for
    job = backend.submit_export(record, chosen, out, dtype, merge)
    when = f"after job {job.after} completes" if job.after else "now (the training job is over)"
    click.echo(
        f"submitted the export of {record.run_id} as job {job.job_id}, to start {when}; it writes {out}; log {job.log}"
    )
