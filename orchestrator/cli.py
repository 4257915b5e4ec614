"""The `fsdpjob` command line: thin click commands over pure functions; formats errors; nothing else."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from fsdpjob.orchestrator import __version__
from fsdpjob.orchestrator.core.errors import FsdpjobError, InputError, PlanRefused

SPEC_ARG = click.argument("spec", type=click.Path(dir_okay=False, path_type=str))
PROFILE_OPT = click.option("--profile", "-p", help="Cluster profile name or YAML path (overrides the spec's profile).")
SET_OPT = click.option(
    "--set", "sets", multiple=True, metavar="KEY=VALUE", help="Override a spec field, e.g. --set train.lr=1e-4 (YAML value)."
)
JSON_OPT = click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")


def _in_existing_folder(ctx: click.Context, param: click.Parameter, value: Path | None) -> Path | None:
    """An output file option's folder must exist: a usage error (exit 2) before any work, not one after it."""
    if value is not None and not value.absolute().parent.is_dir():
        raise click.BadParameter(f"folder {value.parent} does not exist; create it or write the file elsewhere")
    return value


def _echo_json(data: object) -> None:
    click.echo(json.dumps(data, indent=2, sort_keys=True, default=str))


class _LazyGroup(click.Group):
    """Loads the dev-cluster commands only when asked for: every other command starts faster."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted([*super().list_commands(ctx), "dev-cluster"])

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name == "dev-cluster":
            from .devcluster.cli import dev_cluster

            return dev_cluster
        return super().get_command(ctx, name)


@click.group(cls=_LazyGroup, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(__version__, prog_name="fsdpjob")
@click.option("--debug", is_flag=True, help="Show tracebacks for errors.")
def cli(debug: bool) -> None:
    """Fine-tune Hugging Face causal LMs with FSDP2 on Slurm (or on this machine with --profile local).

    Start with: fsdpjob quickstart && fsdpjob submit examples/quickstart.yaml --wait
    """


@cli.command()
@click.argument("specs", nargs=-1, required=True, type=click.Path(dir_okay=False, path_type=str))
@PROFILE_OPT
@SET_OPT
@click.option("--no-file-checks", is_flag=True, help="Skip checks of the model folder and data file.")
def validate(specs: tuple[str, ...], profile: str | None, sets: tuple[str, ...], no_file_checks: bool) -> None:
    """Validate job specs (and their model folder and data file). Exit 2 on the first invalid one."""
    from fsdpjob.orchestrator.core.validation import SpecErrors
    from fsdpjob.orchestrator.planner.jobload import load_job

    failed: list[FsdpjobError] = []
    for path in specs:
        try:
            job = load_job(path, profile=profile, overrides=sets, check_files=not no_file_checks)
        except FsdpjobError as exc:
            failed.append(exc)
            continue
        click.echo(f"{path}: ok (profile {job.profile.name}, world size {job.eff.world_size}, sha256:{job.spec.spec_hash()})")
        if not no_file_checks:
            from fsdpjob.orchestrator.core.dataformats import long_example_warnings

            for warning in long_example_warnings(job.spec.data, Path(job.spec.model.path)):
                click.echo(f"warning: {path}: {warning}", err=True)
    if failed:
        errors = [e for exc in failed for e in (exc.errors if isinstance(exc, SpecErrors) else [exc])]
        raise SpecErrors(errors) if len(errors) > 1 else failed[0]


@cli.command()
@SPEC_ARG
@PROFILE_OPT
@SET_OPT
@click.option("--run-dir", type=click.Path(file_okay=False, path_type=Path), help="Run folder to render for.")
@click.option("--no-file-checks", is_flag=True, help="Skip checks of the model folder and data file.")
def render(spec: str, profile: str | None, sets: tuple[str, ...], run_dir: Path | None, no_file_checks: bool) -> None:
    """Print the exact sbatch script `fsdpjob submit` would submit (touches nothing)."""
    from fsdpjob.orchestrator.planner.jobload import load_job
    from fsdpjob.orchestrator.submit import dry_run

    job = load_job(spec, profile=profile, overrides=sets, check_files=not no_file_checks)
    click.echo(dry_run(job, run_dir.resolve() if run_dir else None).text, nl=False)


@cli.command()
def schema() -> None:
    """Print the JSON Schema of job specs (for editors' YAML language servers)."""
    from fsdpjob.orchestrator.core.spec import json_schema

    _echo_json(json_schema())


@cli.command()
@JSON_OPT
def profiles(as_json: bool) -> None:
    """List the cluster profiles (shipped ones and those in $FSDPJOB_PROFILES)."""
    from fsdpjob.orchestrator.core.profiles import available_profiles, load_profile

    rows = []
    for name, path in available_profiles().items():
        p = load_profile(str(path))
        rows.append(
            {
                "name": name,
                "scheduler": p.scheduler,
                "partition": p.partition,
                "gpus_per_node": p.gpus_per_node,
                "gpu_type": p.gpu_type,
                "gpu_memory_gb": p.gpu_memory_gb,
                "host_ram_gb": p.host_ram_gb,
                "max_time": p.max_time,
                "description": p.description,
                "path": str(path),
            }
        )
    if as_json:
        _echo_json(rows)
        return
    from fsdpjob.orchestrator.views.display import table

    click.echo(
        table(
            ["name", "scheduler", "partition", "GPUs/node", "GPU", "host RAM", "max time", "description"],
            [
                [
                    r["name"],
                    r["scheduler"],
                    r["partition"] or "-",
                    str(r["gpus_per_node"]),
                    r["gpu_type"] or "-",
                    f"{r['host_ram_gb']:g} GB",
                    r["max_time"] or "-",
                    r["description"],
                ]
                for r in rows
            ],
        )
    )


@cli.command()
@SPEC_ARG
@PROFILE_OPT
@SET_OPT
@JSON_OPT
def plan(spec: str, profile: str | None, sets: tuple[str, ...], as_json: bool) -> None:
    """Check before queueing that the job fits: GPU and host memory, checkpoint size and save time, signal lead.

    Needs only the model's config.json (plan before the download); validate and submit check the weights too."""
    from fsdpjob.orchestrator.planner.fit import make_plan
    from fsdpjob.orchestrator.planner.jobload import load_job
    from fsdpjob.orchestrator.planner.planformat import format_plan

    job = load_job(spec, profile=profile, overrides=sets, check_files="config")  # before the download: config.json
    result = make_plan(job)
    if as_json:
        _echo_json(result.to_json())
    else:
        click.echo(format_plan(result))
    if _refusal(result, spec, force=False):
        raise SystemExit(2)


def _refusal(fit, spec: str, *, force: bool) -> PlanRefused | None:
    """Why submit would not submit this plan (FitPlan.verdict), or None: plan, submit --dry-run and submit
    all ask this one question, so they agree on the verdict and the exit code."""
    if force or fit.verdict == "FITS":
        return None
    if fit.verdict == "REFUSED":
        return PlanRefused(f"{spec}: {fit.refusal} (or pass --force)")
    return PlanRefused("the planner says this job does not fit (see the plan above); apply a fix or pass --force")


@cli.command()
@SPEC_ARG
@PROFILE_OPT
@SET_OPT
@click.option("--dry-run", is_flag=True, help="Print the plan and the request; touch nothing; exit as submit would.")
@click.option("--wait", is_flag=True, help="Stream progress until the job ends; exit with its status.")
@click.option("--force", is_flag=True, help="Submit even if the planner says the job cannot fit.")
@click.option("--resume-from", type=click.Path(exists=True, path_type=str), help="Start from this checkpoint (a step-N folder, a checkpoints folder or a run folder).")
@click.option("--run-dir", type=click.Path(file_okay=False, path_type=Path), help="Run folder (default: $FSDPJOB_HOME/runs/<name>-<time>-<id>).")
@click.option("--no-file-checks", is_flag=True, help="With --dry-run: skip checks of the model folder and data file "
              "(the plan still reads config.json).")
@JSON_OPT
def submit(spec, profile, sets, dry_run, wait, force, resume_from, run_dir, no_file_checks, as_json) -> None:
    """Validate, plan, and submit a job (Slurm through submitit, or local processes with --profile local)."""
    from fsdpjob.orchestrator import submit as submission
    from fsdpjob.orchestrator.planner.fit import make_plan
    from fsdpjob.orchestrator.planner.jobload import load_job
    from fsdpjob.orchestrator.planner.planformat import format_plan

    if no_file_checks and not dry_run:
        raise click.UsageError("--no-file-checks goes with --dry-run only: a real submit checks the files first")
    job = load_job(spec, profile=profile, overrides=sets, check_files=not no_file_checks, resume_from=resume_from)
    fit = make_plan(job)
    refusal = _refusal(fit, spec, force=force)
    if dry_run:
        request = submission.dry_run(job, run_dir.resolve() if run_dir else None)
        if as_json:
            _echo_json(submission.request_json(job, request, fit.to_json()))
        else:
            click.echo(format_plan(fit), err=True)
            click.echo(request.text, nl=False)
        if refusal:
            raise refusal
        return
    if refusal:
        if fit.verdict == "DOES NOT FIT":
            click.echo(format_plan(fit), err=True)
        raise refusal
    for warning in fit.warnings:
        click.echo(f"warning: {warning}", err=True)
    sub = submission.submit(job, run_dir=run_dir.resolve() if run_dir else None, resume_from=resume_from,
                            worker_facts=fit.worker_facts())
    if as_json:
        _echo_json({"run_id": sub.record.run_id, "job_id": sub.record.job_id, "run_dir": sub.record.run_dir})
    else:
        click.echo(f"submitted {sub.record.run_id} (job {sub.record.job_id}, {job.profile.name}); run folder {sub.record.run_dir}")
    if wait:
        from fsdpjob.orchestrator.views.follow import wait_for

        raise SystemExit(wait_for(sub.record))


@cli.command()
@click.argument("run", required=False)
@JSON_OPT
def status(run: str | None, as_json: bool) -> None:
    """Status of a run (default: the newest): scheduler state joined with training progress."""
    from fsdpjob.orchestrator import registry
    from fsdpjob.orchestrator.views.status import report_for

    record = registry.find(run) if run else registry.latest()
    report = report_for(record)
    if as_json:
        _echo_json(report.to_json())
        return
    from fsdpjob.orchestrator.views.display import status_text

    click.echo(status_text(report))


@cli.command(name="list")
@JSON_OPT
def list_runs(as_json: bool) -> None:
    """All runs in the registry, with one scheduler call."""
    from fsdpjob.orchestrator import registry
    from fsdpjob.orchestrator.views.status import reports

    rows = reports(registry.all_records())
    if as_json:
        _echo_json([r.to_json() for r in rows])
        return
    from fsdpjob.orchestrator.views.display import table

    click.echo(
        table(
            ["run", "job", "phase", "step", "loss", "ckpt", "restarts", "profile"],
            [
                [r.run_id, r.job_id, r.phase, f"{r.step if r.step is not None else '-'}/{r.max_steps}",
                 f"{r.loss:.4f}" if r.loss is not None else "-",
                 str(r.last_checkpoint_step) if r.last_checkpoint_step is not None else "-", str(r.restarts), r.profile]
                for r in rows
            ],
        )
    )


@cli.command()
@click.argument("run")
@JSON_OPT
@click.option("--plot", "plot_file", type=click.Path(dir_okay=False, path_type=Path), callback=_in_existing_folder,
              help="Also draw loss, tokens/s, attempts, interruptions and the breakdown into this PNG.")
def report(run: str, as_json: bool, plot_file: Path | None) -> None:
    """Goodput: where every allocated GPU-second of a run went, across all its attempts."""
    from fsdpjob.orchestrator import registry
    from fsdpjob.orchestrator.views import goodputplot
    from fsdpjob.orchestrator.views.goodputreport import format_report, run_report

    if plot_file is not None and not goodputplot.available():
        click.echo(f"fsdpjob: --plot needs matplotlib: {goodputplot.INSTALL_HINT}", err=True)
        raise SystemExit(2)
    result = run_report(registry.find(run))
    for warning in result.warnings:
        click.echo(f"warning: {warning}", err=True)
    data = result.to_json()
    if plot_file is not None:
        goodputplot.render(data, plot_file)
        click.echo(f"plot: {plot_file}", err=True)
    if as_json:
        _echo_json(data)
    else:
        click.echo(format_report(result))


@cli.command()
@click.argument("run")
@click.option("--rank", type=int, default=0, show_default=True, help="Worker rank whose log to show.")
@click.option("--follow", "-f", is_flag=True, help="Keep printing new lines until the job ends.")
@click.option("--stderr", "stream", flag_value="err", default="out", help="Show stderr instead of stdout.")
@click.option("--stacks", is_flag=True, help="Print every rank's Python stacks from the newest hang the supervisor caught.")
def logs(run: str, rank: int, follow: bool, stream: str, stacks: bool) -> None:
    """Print a worker's log (all attempts of a requeued job are in one file), or the stacks of a hang."""
    from fsdpjob.orchestrator import registry
    from fsdpjob.orchestrator.views.follow import follow_file, log_path

    record = registry.find(run)
    if stacks:
        from fsdpjob.orchestrator.views.stackview import newest_stacks

        click.echo(newest_stacks(Path(record.run_dir)), nl=False)
        return
    path = log_path(record, rank, stream)
    if not follow:
        if not path.exists():
            raise FsdpjobError(f"no log yet at {path} (the job may still be pending)")
        click.echo(path.read_text(encoding="utf-8", errors="replace"), nl=False)
        return
    follow_file(record, path)


@cli.command()
@click.argument("run")
def cancel(run: str) -> None:
    """Cancel a run (scancel, or stop the local workers)."""
    from fsdpjob.orchestrator import registry
    from fsdpjob.orchestrator.submit import cancel as cancel_run

    record = registry.find(run)
    how = cancel_run(record)
    click.echo(f"cancelled {record.run_id} (job {record.job_id}): {how}")


@cli.command()
@click.argument("source", type=click.Path(exists=True, path_type=Path))
@click.option("--out", required=True, type=click.Path(file_okay=False, path_type=Path), help="Output folder.")
@click.option("--dtype", type=click.Choice(["bf16", "fp32"]), default="bf16", show_default=True)
@click.option("--merge", is_flag=True, help="LoRA runs: merge the adapters into the base model (default: the "
              "peft adapter folder).")
def export(source: Path, out: Path, dtype: str, merge: bool) -> None:
    """Write a Hugging Face folder (sharded safetensors) from a run or a checkpoint; for a LoRA run, a peft
    adapter folder, or with --merge the merged model."""
    from fsdpjob.jobs.checkpoint import CheckpointError
    from fsdpjob.jobs.export import export_from_path

    try:
        written = export_from_path(source, out, dtype, merge=merge)
    except CheckpointError as exc:
        raise FsdpjobError(f"cannot export {source}: {exc}") from None
    click.echo(f"exported {written} -> {out}")


@cli.command()
@click.argument("directory", type=click.Path(file_okay=False, path_type=Path), default="examples/quickstart-assets")
def quickstart(directory: Path) -> None:
    """Create the quickstart's tiny Llama model, tokenizer and data set locally (no downloads)."""
    from fsdpjob.jobs.quickstart import make_quickstart

    made = make_quickstart(directory)
    click.echo(f"model: {made['model_path']}\ndata:  {made['data_path']}")


def main(argv: list[str] | None = None) -> None:
    """Entry point: runs the click group and turns errors into one-line messages and exit codes."""
    args = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in args
    try:
        rc = cli.main(args=args, prog_name="fsdpjob", standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("Aborted.", err=True)
        sys.exit(130)
    except click.UsageError as exc:
        exc.show()
        sys.exit(2)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except FsdpjobError as exc:
        if debug:
            raise
        click.echo(exc.format() if isinstance(exc, InputError) else f"fsdpjob: {exc}", err=True)
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        sys.exit(130)
    except Exception as exc:  # noqa: BLE001 - the last line of defence against tracebacks
        if debug:
            raise
        click.echo(f"fsdpjob: internal error: {type(exc).__name__}: {exc} (rerun with --debug for the traceback)", err=True)
        sys.exit(1)
    sys.exit(rc if isinstance(rc, int) else 0)


if __name__ == "__main__":
    main()
