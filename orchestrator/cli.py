"""The `fsdpjob` command line: thin click commands over pure functions; formats errors; nothing else."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from fsdpjob.orchestrator import __version__
from fsdpjob.orchestrator.completion import complete_profiles, complete_runs
from fsdpjob.orchestrator.core.errors import FsdpjobError, InputError, PlanRefused

SPEC_ARG = click.argument("spec", type=click.Path(dir_okay=False, path_type=str))
PROFILE_OPT = click.option(
    "--profile",
    "-p",
    shell_complete=complete_profiles,
    help="Cluster profile name or YAML path (overrides the spec's profile).",
)
SET_OPT = click.option(
    "--set",
    "sets",
    multiple=True,
    metavar="KEY=VALUE",
    help="Override a spec field, e.g. --set train.lr=1e-4 (YAML value).",
)
JSON_OPT = click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")
RUN_ARG = click.argument("run", shell_complete=complete_runs)
WATCH_OPT = click.option("--watch", "-w", is_flag=True, help="Redraw in place every --interval seconds (Ctrl-C stops).")
AFTER_OPT = click.option(
    "--after",
    metavar="RUN[:ok|any]",
    help="Start only after RUN (run id, prefix, job id or "
    "name) completes (:ok, the default) or ends however it ends (:any); a Slurm dependency.",
)
SHAPES_OPT = click.option(
    "--shapes",
    metavar="NxG[,NxG...]",
    help="Slurm: also estimate the start and total time of "
    "these shapes (nodes x GPUs per node), e.g. 2x8,4x8, to see which finishes first.",
)
INTERVAL_OPT = click.option(
    "--interval",
    type=click.FloatRange(min=0.2),
    default=2.0,
    show_default=True,
    metavar="SECONDS",
    help="Seconds between redraws with --watch.",
)


def _echo_json(data: object) -> None:
    click.echo(json.dumps(data, indent=2, sort_keys=True, default=str))


def _watch_is_text(watch: bool, as_json: bool) -> None:
    if watch and as_json:
        raise InputError("redraws text for a person; drop --json, or poll `--json` from a script", file="--watch")


class _Command(click.Command):
    """A command whose line in `fsdpjob --help` shows its docstring's whole first sentence (click would cut it
    at the terminal's width; the help's table wraps it instead)."""

    def get_short_help_str(self, limit: int = 45) -> str:
        return super().get_short_help_str(limit=10_000)


class _LazyGroup(click.Group):
    """Loads the dev-cluster commands only when asked for: every other command starts faster."""

    command_class = _Command

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
            job = load_job(
                path,
                profile=profile,
                overrides=sets,
                check_files=not no_file_checks,
                ask_partition_size=_partition_size(),
            )
        except FsdpjobError as exc:
            failed.append(exc)
            continue
        click.echo(
            f"{path}: ok (profile {job.profile.name}, world size {job.eff.world_size}, sha256:{job.spec.spec_hash()})"
        )
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
@SHAPES_OPT
@JSON_OPT
def plan(spec: str, profile: str | None, sets: tuple[str, ...], shapes: str | None, as_json: bool) -> None:
    """Check before queueing that the job fits: GPU and host memory, checkpoint size and save time, signal lead.

    Needs only the model's config.json (plan before the download); validate and submit check the weights too."""
    from fsdpjob.orchestrator.planner.fit import make_plan
    from fsdpjob.orchestrator.planner.jobload import load_job
    from fsdpjob.orchestrator.planner.planformat import format_plan

    job = load_job(
        spec,
        profile=profile,
        overrides=sets,
        check_files="config",  # before the download: config.json
        ask_partition_size=_partition_size(),
    )
    result = make_plan(job)
    estimates = _start_estimates(job, result, spec, profile, sets, shapes)
    if as_json:
        _echo_json({**result.to_json(), **({"start_estimates": estimates} if estimates else {})})
    else:
        click.echo(format_plan(result))
        _echo_estimates(estimates, err=True)  # stdout stays the plan, whose last line is the verdict
    if _refusal(result, spec, force=False):
        raise SystemExit(2)


def _partition_size():
    """What validate, plan and submit ask Slurm (one sinfo call, when the profile is a Slurm one): how many nodes
    the job's partition has; nothing is refused when Slurm cannot be reached from here."""
    from fsdpjob.orchestrator.slurm.commands import partition_size

    return partition_size


def _start_estimates(job, fit, spec: str, profile: str | None, sets: tuple[str, ...], shapes: str | None) -> list[dict]:
    """Slurm's start estimate for the job, and for each of --shapes (orchestrator/estimate.py)."""
    from dataclasses import replace

    from fsdpjob.orchestrator.estimate import start_estimates
    from fsdpjob.orchestrator.planner.fit import make_plan
    from fsdpjob.orchestrator.planner.jobload import load_job

    def shaped(nodes: int, gpus: int):
        other = load_job(
            spec,
            profile=profile,
            check_files=False,
            overrides=(*sets, f"resources.nodes={nodes}", f"resources.gpus_per_node={gpus}"),
        )
        return replace(other, dependency=job.dependency), make_plan(other)

    return start_estimates(job, fit, shapes, shaped)


def _echo_estimates(rows: list[dict], *, err: bool) -> None:
    """Slurm's start estimates for a person (one line when Slurm could not be asked)."""
    from fsdpjob.orchestrator.estimate import format_estimates

    for line in format_estimates(rows):
        click.echo(line, err=err)


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
@AFTER_OPT
@SHAPES_OPT
@JSON_OPT
def submit(
    spec, profile, sets, dry_run, wait, force, resume_from, run_dir, no_file_checks, after, shapes, as_json
) -> None:
    """Validate, plan, and submit a job (Slurm through submitit, or local processes with --profile local)."""
    from fsdpjob.orchestrator import submit as submission
    from fsdpjob.orchestrator.planner.fit import make_plan
    from fsdpjob.orchestrator.planner.jobload import load_job
    from fsdpjob.orchestrator.planner.planformat import format_plan

    if no_file_checks and not dry_run:
        raise click.UsageError("--no-file-checks goes with --dry-run only: a real submit checks the files first")
    if shapes and not dry_run:
        raise click.UsageError("--shapes goes with --dry-run (or plan): it compares start estimates, submits nothing")
    job = load_job(
        spec,
        profile=profile,
        overrides=sets,
        check_files=not no_file_checks,
        resume_from=resume_from,
        ask_partition_size=_partition_size(),
    )
    dependency = None
    if after:
        from dataclasses import replace

        from fsdpjob.orchestrator.chain import resolve_after

        dependency = resolve_after(after, job.profile.scheduler)
        job = replace(job, dependency=dependency.directive)
    fit = make_plan(job)
    refusal = _refusal(fit, spec, force=force)
    if dry_run:
        request = submission.dry_run(job, run_dir.resolve() if run_dir else None)
        estimates = _start_estimates(job, fit, spec, profile, sets, shapes)
        if as_json:
            _echo_json({**submission.request_json(job, request, fit.to_json()), "start_estimates": estimates})
        else:
            click.echo(format_plan(fit), err=True)
            _echo_estimates(estimates, err=True)
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
    sub = submission.submit(
        job,
        run_dir=run_dir.resolve() if run_dir else None,
        resume_from=resume_from,
        worker_facts=fit.worker_facts(),
        extra={"after": dependency.to_json()} if dependency else None,
    )
    if as_json:
        _echo_json({"run_id": sub.record.run_id, "job_id": sub.record.job_id, "run_dir": sub.record.run_dir})
    else:
        click.echo(
            f"submitted {sub.record.run_id} (job {sub.record.job_id}, {job.profile.name}); run folder {sub.record.run_dir}"
            + (f"; starts after {dependency.run_id} (job {dependency.job_id}, {dependency.kind})" if dependency else "")
        )
    if wait:
        from fsdpjob.orchestrator.submit import cancel as cancel_run
        from fsdpjob.orchestrator.views.follow import wait_for

        try:
            raise SystemExit(wait_for(sub.record))
        except KeyboardInterrupt:
            if sub.record.scheduler != "local":
                raise  # a Slurm job goes on; `fsdpjob wait` re-attaches
            # A local run is this terminal's job: Ctrl-C stops it as `fsdpjob cancel` does (a stop checkpoint, a
            # cancelled stop), not by the SIGINT, which its own session keeps from the workers.
            click.echo(f"cancelling {sub.record.run_id}: {cancel_run(sub.record)}", err=True)
            raise SystemExit(130) from None


@cli.command()
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
@JSON_OPT
def sweep(spec, grids, sweep_file, max_parallel, name, profile, sets, dry_run, force, as_json) -> None:
    """Run variants of a spec (a grid of values, or a list of --set variants) as one Slurm array job, each a run
    of its own; on the local profile one after another. Every variant is checked before anything is submitted."""
    from fsdpjob.orchestrator import sweepsubmit
    from fsdpjob.orchestrator.sweep import make_sweep

    wanted = make_sweep(grids, sweep_file=sweep_file, name=name, max_parallel=max_parallel)
    plan = sweepsubmit.plan_sweep(spec, wanted, profile=profile, sets=sets, force=force)
    slurm = plan.scheduler == "slurm"
    script = sweepsubmit.array_script(plan, spec) if slurm else None  # refuses a variant that changes the shape
    if dry_run:
        if as_json:
            _echo_json(
                {
                    "sweep": plan.sweep_id,
                    "name": plan.name,
                    "array": plan.array if slurm else None,
                    "variants": [
                        {"index": p.variant.index, "name": p.job.spec.name, "sets": list(p.variant.sets)}
                        for p in plan.variants
                    ],
                    "script": script,
                }
            )
            return
        for p in plan.variants:
            click.echo(f"variant {p.variant.index}: {p.job.spec.name}: {p.variant.label()}", err=True)
        click.echo(script if slurm else f"local profile: the {len(plan.variants)} runs one after another\n", nl=False)
        return
    warned: dict[str, list[str]] = {}
    for p in plan.variants:
        for warning in p.warnings:
            warned.setdefault(warning, []).append(str(p.variant.index))
    for warning, which in warned.items():
        whom = "every variant" if len(which) == len(plan.variants) else f"variant {', '.join(which)}"
        click.echo(f"warning: {whom}: {warning}", err=True)
    if slurm:
        records = sweepsubmit.submit_array(plan, spec)
        if as_json:
            _echo_json(
                {
                    "sweep": plan.sweep_id,
                    "name": plan.name,
                    "job_id": records[0].sweep["job_id"],
                    "runs": [
                        {"index": r.sweep["index"], "run_id": r.run_id, "job_id": r.job_id, "run_dir": r.run_dir}
                        for r in records
                    ],
                }
            )
            return
        click.echo(
            f"submitted sweep {plan.name} ({plan.sweep_id}): array job {records[0].sweep['job_id']} "
            f"(--array={plan.array}), {len(records)} runs"
        )
        for r in records:
            values = " ".join(f"{k}={v}" for k, v in r.sweep["values"].items())
            click.echo(f"  {r.sweep['index']}: {r.run_id} (job {r.job_id}): {values}")
        return
    if max_parallel and max_parallel > 1:
        click.echo(
            "warning: the local profile runs a sweep's variants one after another; --max-parallel is ignored", err=True
        )
    from fsdpjob.orchestrator.views.follow import wait_for

    results: list[int] = []

    def follow(record) -> None:
        click.echo(f"sweep {plan.name}: run {record.sweep['index'] + 1} of {len(plan.variants)}: {record.run_id}")
        results.append(wait_for(record))

    sweepsubmit.run_locally(plan, follow)
    raise SystemExit(1 if any(results) else 0)


@cli.command()
@click.argument("run", required=False, shell_complete=complete_runs)
@JSON_OPT
@WATCH_OPT
@INTERVAL_OPT
def status(run: str | None, as_json: bool, watch: bool, interval: float) -> None:
    """Status of a run (default: the newest): scheduler state joined with training progress."""
    from fsdpjob.orchestrator import registry
    from fsdpjob.orchestrator.views.display import status_text
    from fsdpjob.orchestrator.views.status import report_for

    _watch_is_text(watch, as_json)
    if run and (tasks := registry.sweep_records(run)):
        _sweep_status(tasks, as_json, watch, interval)
        return
    record = registry.find(run) if run else registry.latest()
    if watch:
        from fsdpjob.orchestrator.views.follow import TERMINAL
        from fsdpjob.orchestrator.views.watch import watch as watch_view

        def draw() -> tuple[str, bool]:
            now = report_for(record)
            return status_text(now), now.phase in TERMINAL

        watch_view(draw, interval)
        return
    report = report_for(record)
    if as_json:
        _echo_json(report.to_json())
        return
    click.echo(status_text(report))


@cli.command(name="list")
@JSON_OPT
@WATCH_OPT
@INTERVAL_OPT
def list_runs(as_json: bool, watch: bool, interval: float) -> None:
    """All runs in the registry, with one scheduler call."""
    from fsdpjob.orchestrator import registry
    from fsdpjob.orchestrator.views.status import reports

    _watch_is_text(watch, as_json)
    if watch:
        from fsdpjob.orchestrator.views.watch import watch as watch_view

        watch_view(lambda: (_runs_list(registry.all_records()), False), interval)
        return
    records = registry.all_records()
    rows = reports(records)
    if as_json:
        _echo_json([{**r.to_json(), "sweep": rec.sweep} for rec, r in zip(records, rows)])
        return
    click.echo(_runs_list(records, rows))


def _runs_list(records, rows=None) -> str:
    """`fsdpjob list`: a sweep's runs together under its line (views/sweepview.list_text), other runs as they are."""
    from fsdpjob.orchestrator.views.status import reports
    from fsdpjob.orchestrator.views.sweepview import list_text

    return list_text(records, reports(records) if rows is None else rows)


def _sweep_status(tasks, as_json: bool, watch: bool, interval: float) -> None:
    from fsdpjob.orchestrator.views import sweepview

    if watch:
        from fsdpjob.orchestrator.views.follow import TERMINAL
        from fsdpjob.orchestrator.views.watch import watch as watch_view

        def draw() -> tuple[str, bool]:
            now = sweepview.sweep_status(tasks)
            return sweepview.status_text(tasks, now), all(r.phase in TERMINAL for r in now)

        watch_view(draw, interval)
        return
    now = sweepview.sweep_status(tasks)
    if as_json:
        _echo_json(sweepview.status_json(tasks, now))
    else:
        click.echo(sweepview.status_text(tasks, now))


def _output_file(option: str, path: Path) -> None:
    """A file the command will write: refused before any work if it cannot be (one line, exit 2)."""
    if path.is_dir():
        raise InputError(f"{path} is a folder; name a file to write", loc=option)
    if not path.parent.is_dir():
        raise InputError(
            f"cannot write {path}: there is no folder {path.parent}; create it first or name a file "
            "in a folder that exists",
            loc=option,
        )


def _write_output(option: str, path: Path, data: bytes) -> None:
    try:
        path.write_bytes(data)
    except OSError as exc:  # no permission, a full disk: the user's to fix, not an internal error
        raise InputError(f"cannot write {path}: {exc.strerror or exc}", loc=option) from None
    click.echo(f"{option.lstrip('-')}: {path}", err=True)


@cli.command()
@RUN_ARG
@JSON_OPT
@click.option(
    "--plot",
    "plot_file",
    type=click.Path(path_type=Path),
    help="Also draw the picture (loss against step, progress against wall time, the breakdown) into this PNG.",
)
@click.option(
    "--html",
    "html_file",
    type=click.Path(path_type=Path),
    help="Also write the whole report, picture included, as one self-contained HTML page to this file.",
)
def report(run: str, as_json: bool, plot_file: Path | None, html_file: Path | None) -> None:
    """Goodput: where every allocated GPU-second of a run went, across all its attempts."""
    from fsdpjob.orchestrator import registry
    from fsdpjob.orchestrator.views import goodputplot
    from fsdpjob.orchestrator.views.goodputreport import format_report, run_report

    for option, path in (("--plot", plot_file), ("--html", html_file)):
        if path is not None:
            _output_file(option, path)
            if not goodputplot.available():
                click.echo(f"fsdpjob: {option} needs matplotlib: {goodputplot.INSTALL_HINT}", err=True)
                raise SystemExit(2)
    if tasks := registry.sweep_records(run):
        _sweep_report(tasks, as_json, plot_file, html_file)
        return
    record = registry.find(run)
    result = run_report(record)
    for warning in result.warnings:
        click.echo(f"warning: {warning}", err=True)
    data = result.to_json()
    png = goodputplot.run_png(data, record.run_dir) if plot_file or html_file else b""
    if plot_file is not None:
        _write_output("--plot", plot_file, png)
    if html_file is not None:
        from fsdpjob.orchestrator.views.reporthtml import page

        _write_output("--html", html_file, page(result, png, record.scheduler).encode("utf-8"))
    if as_json:
        _echo_json(data)
    else:
        click.echo(format_report(result))


def _sweep_report(tasks, as_json: bool, plot_file: Path | None, html_file: Path | None) -> None:
    from fsdpjob.orchestrator.views import sweepview

    rows = sweepview.sweep_report(tasks)
    png = sweepview.curves_png(tasks, rows) if plot_file or html_file else b""
    if plot_file is not None:
        _write_output("--plot", plot_file, png)
    if html_file is not None:
        _write_output("--html", html_file, sweepview.report_html(tasks, rows, png).encode("utf-8"))
    if as_json:
        _echo_json(sweepview.report_json(tasks, rows))
    else:
        click.echo(sweepview.report_text(tasks, rows))


@cli.command()
@RUN_ARG
@click.option("--rank", type=int, default=0, show_default=True, help="Worker rank whose log to show.")
@click.option("--follow", "-f", is_flag=True, help="Keep printing new lines until the job ends.")
@click.option("--stderr", "stream", flag_value="err", default="out", help="Show stderr instead of stdout.")
@click.option(
    "--stacks", is_flag=True, help="Print every rank's Python stacks from the newest hang the supervisor caught."
)
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
@RUN_ARG
def cancel(run: str) -> None:
    """Cancel a run (scancel, or stop the local workers), or every running and pending run of a sweep."""
    from fsdpjob.orchestrator import registry
    from fsdpjob.orchestrator.submit import cancel as cancel_run

    if tasks := registry.sweep_records(run):
        from fsdpjob.orchestrator.views.sweepview import LIVE, sweep_status

        live = [rec for rec, rep in zip(tasks, sweep_status(tasks)) if rep.phase in LIVE]  # one scheduler call
        for rec in live:
            click.echo(f"cancelled {rec.run_id} (job {rec.job_id}): {cancel_run(rec)}")
        click.echo(f"sweep {run}: cancelled {len(live)} of {len(tasks)} runs (the others had ended)")
        return
    record = registry.find(run)
    how = cancel_run(record)
    click.echo(f"cancelled {record.run_id} (job {record.job_id}): {how}")


@cli.command()
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
    if as_job and best:
        raise click.UsageError(
            "--best goes without --submit: export the sweep's best run with `fsdpjob export RUN "
            "--submit` once the sweep has finished"
        )
    if as_job:
        _export_job(source, out, dtype, merge, profile)
        return
    if profile:
        raise click.UsageError("--profile goes with --submit (the profile of the export job)")
    from fsdpjob.jobs.checkpoint import CheckpointError
    from fsdpjob.jobs.export import export_from_path

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
        written = export_from_path(path, out, dtype, merge=merge)
    except CheckpointError as exc:
        raise FsdpjobError(f"cannot export {source}: {exc}") from None
    click.echo(f"exported {written} -> {out}")


def _export_job(source: str, out: Path, dtype: str, merge: bool, profile: str | None) -> None:
    from fsdpjob.orchestrator import registry
    from fsdpjob.orchestrator.core.profiles import load_profile
    from fsdpjob.orchestrator.exportjob import submit_export

    if not profile:
        raise click.UsageError("--submit needs --profile/-p: the Slurm profile (partition) the export job runs on")
    record = registry.find(source)  # a run of the registry: its job is what the export waits for
    job = submit_export(record, load_profile(profile), out, dtype, merge)
    when = f"after job {job.after} completes" if job.after else "now (the training job is over)"
    click.echo(
        f"submitted the export of {record.run_id} as job {job.job_id}, to start {when}; it writes {out}; log {job.log}"
    )


@cli.command()
@click.argument("directory", required=False, type=click.Path(file_okay=False, path_type=Path))
def quickstart(directory: Path | None) -> None:
    """Create the quickstart's tiny Llama model, tokenizer and data set locally (no downloads).

    DIRECTORY: by default examples/quickstart-assets when run in a checkout of fsdpjob (beside
    examples/quickstart.yaml, which reads it), else $FSDPJOB_HOME/quickstart-assets."""
    from fsdpjob.jobs.quickstart import make_quickstart
    from fsdpjob.orchestrator.firstjob import quickstart_place

    place = quickstart_place(directory, Path.cwd())
    made = make_quickstart(place.assets)
    click.echo(f"model: {made['model_path']}\ndata:  {made['data_path']}")
    click.echo(f"next:  {place.next_command(made['model_path'], made['data_path'])}")


# --- the commands around a run's life: a starter spec, the resolved spec, re-attaching, cleaning up ---------------


@cli.command()
@click.argument("model_dir", required=False, type=click.Path(path_type=Path))
@click.option(
    "--profile",
    "-p",
    default="local",
    show_default=True,
    shell_complete=complete_profiles,
    help="Cluster profile name or YAML path the spec is for.",
)
@click.option(
    "--out",
    "-o",
    type=click.Path(dir_okay=False, path_type=Path),
    default="job.yaml",
    show_default=True,
    help="Where to write the spec (an existing file is never overwritten).",
)
@click.option(
    "--data",
    type=click.Path(dir_okay=False, path_type=Path),
    help="The training data (JSONL) [default: data.jsonl beside the spec].",
)
def init(model_dir: Path | None, profile: str, out: Path, data: Path | None) -> None:
    """Write a commented starter spec that validates, for MODEL_DIR (a local Hugging Face model folder)."""
    from fsdpjob.orchestrator.firstjob import write_starter

    written = write_starter(out, profile, model_dir, data)
    click.echo(f"wrote {out}; check it with: fsdpjob validate {written.quoted_out}")
    for todo in written.todo:
        click.echo(f"then: {todo}", err=True)


@cli.command()
@SPEC_ARG
@PROFILE_OPT
@SET_OPT
@JSON_OPT
def show(spec: str, profile: str | None, sets: tuple[str, ...], as_json: bool) -> None:
    """Print the resolved spec: every default, the profile's values filled in, paths absolute (YAML or --json).

    Secrets are shown as <secret>; files are not checked (`fsdpjob validate` does that)."""
    import yaml

    from fsdpjob.orchestrator.planner.jobload import load_job
    from fsdpjob.orchestrator.planner.resolved import resolved_spec

    data = resolved_spec(load_job(spec, profile=profile, overrides=sets, check_files=False))
    if as_json:
        _echo_json(data)
    else:
        click.echo(yaml.safe_dump(data, sort_keys=False, allow_unicode=True), nl=False)


@cli.command(name="wait")
@RUN_ARG
def wait_run(run: str) -> None:
    """Re-attach to a run's progress stream (as submit --wait shows it); exit 0 if it completes, else 1.

    Ctrl-C detaches: the run goes on."""
    from fsdpjob.orchestrator import registry
    from fsdpjob.orchestrator.views.follow import wait_for

    raise SystemExit(wait_for(registry.find(run)))


@cli.command()
@click.option(
    "--older-than", type=click.FloatRange(min=0), metavar="DAYS", help="Only runs submitted more than DAYS days ago."
)
@click.option("--keep-last", type=click.IntRange(min=0), metavar="N", help="Keep the N newest finished runs.")
@click.option(
    "--checkpoints-only", is_flag=True, help="Keep the runs; remove all but each one's newest committed checkpoint."
)
@click.option("--yes", is_flag=True, help="Remove for real (without it: a dry run listing what would go).")
def prune(older_than: float | None, keep_last: int | None, checkpoints_only: bool, yes: bool) -> None:
    """Remove finished runs' folders (or their older checkpoints), with the bytes freed; a dry run unless --yes.

    Never touches a pending, running or requeued run, nor a checkpoint such a run was submitted to resume from."""
    from fsdpjob.orchestrator import prune as pruning
    from fsdpjob.orchestrator import registry
    from fsdpjob.orchestrator.views.status import reports

    records = registry.all_records()
    phases = {r.run_id: pruning.settled_phase(r) for r in reports(records)}
    removals = pruning.plan(
        records, phases, older_than_days=older_than, keep_last=keep_last, checkpoints_only=checkpoints_only
    )
    if yes:
        pruning.remove(removals)
    click.echo("\n".join(pruning.summary(removals, removed=yes)))


@cli.command()
@click.argument("shell", type=click.Choice(["bash", "zsh", "fish"]))
def completion(shell: str) -> None:
    """Print the shell completion script: commands, options, run ids and profile names complete with TAB.

    \b
    bash, in ~/.bashrc:  eval "$(fsdpjob completion bash)"
    zsh, in ~/.zshrc:    eval "$(fsdpjob completion zsh)"
    fish:                fsdpjob completion fish > ~/.config/fish/completions/fsdpjob.fish
    """
    from click.shell_completion import get_completion_class

    # click's own completion: the script calls `fsdpjob` back with _FSDPJOB_COMPLETE set, and click answers.
    click.echo(get_completion_class(shell)(cli, {}, "fsdpjob", "_FSDPJOB_COMPLETE").source())


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
        click.echo(
            f"fsdpjob: internal error: {type(exc).__name__}: {exc} (rerun with --debug for the traceback)", err=True
        )
        sys.exit(1)
    sys.exit(rc if isinstance(rc, int) else 0)


if __name__ == "__main__":
    main()
