"""The `fsdpjob` command line: thin click commands over pure functions; formats errors; nothing else."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from . import __version__
from .errors import FsdpjobError, InputError

SPEC_ARG = click.argument("spec", type=click.Path(dir_okay=False, path_type=str))
PROFILE_OPT = click.option("--profile", "-p", help="Cluster profile name or YAML path (overrides the spec's profile).")
SET_OPT = click.option(
    "--set", "sets", multiple=True, metavar="KEY=VALUE", help="Override a spec field, e.g. --set train.lr=1e-4 (YAML value)."
)
JSON_OPT = click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")


def _echo_json(data: object) -> None:
    click.echo(json.dumps(data, indent=2, sort_keys=True, default=str))


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
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
    from .jobload import load_job
    from .spec import SpecErrors

    failed: list[FsdpjobError] = []
    for path in specs:
        try:
            job = load_job(path, profile=profile, overrides=sets, check_files=not no_file_checks)
        except FsdpjobError as exc:
            failed.append(exc)
            continue
        click.echo(f"{path}: ok (profile {job.profile.name}, world size {job.eff.world_size}, sha256:{job.spec.spec_hash()})")
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
    from .jobload import load_job
    from .paths import RunPaths, new_run_id, runs_root
    from .render import build_plan, render_script

    job = load_job(spec, profile=profile, overrides=sets, check_files=not no_file_checks)
    paths = RunPaths(run_dir.resolve() if run_dir else runs_root() / new_run_id(job.spec.name))
    if job.profile.scheduler == "local":
        click.echo(
            f"# profile {job.profile.name!r} is local: no sbatch script; {job.eff.tasks_per_node} worker process(es) "
            f"start on this machine (submitit local executor), run folder {paths.run_dir}",
        )
        return
    click.echo(render_script(build_plan(job.spec, job.profile, paths, spec_source=job.source)), nl=False)


@cli.command()
def schema() -> None:
    """Print the JSON Schema of job specs (for editors' YAML language servers)."""
    from .spec import json_schema

    _echo_json(json_schema())


@cli.command()
@JSON_OPT
def profiles(as_json: bool) -> None:
    """List the cluster profiles (shipped ones and those in $FSDPJOB_PROFILES)."""
    from .profiles import available_profiles, load_profile

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
    from .display import table

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
