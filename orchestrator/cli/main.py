"""The `fsdpjob` command line: the group, its lazy loading of one module per command (or family of commands), and
main(), which turns errors into one-line messages and exit codes. The commands are thin click functions over pure
functions; each module of this package holds one command or family and the glue beside it."""

from __future__ import annotations

import importlib
import sys

import click

from fsdpjob.orchestrator import __version__
from fsdpjob.orchestrator.core.errors import FsdpjobError, InputError

# Command name -> (module, function): a command's module is imported only when it runs (or for --help and TAB
# completion, which list them all), so every command starts without the others' imports.
COMMANDS = {
    "validate": ("spec", "validate"),
    "render": ("spec", "render"),
    "schema": ("spec", "schema"),
    "profiles": ("spec", "profiles"),
    "plan": ("spec", "plan"),
    "show": ("spec", "show"),
    "submit": ("submit", "submit"),
    "sweep": ("sweep", "sweep"),
    "status": ("runs", "status"),
    "list": ("runs", "list_runs"),
    "wait": ("runs", "wait_run"),
    "logs": ("runs", "logs"),
    "cancel": ("runs", "cancel"),
    "report": ("report", "report"),
    "export": ("export", "export"),
    "prune": ("prune", "prune"),
    "init": ("firstjob", "init"),
    "quickstart": ("firstjob", "quickstart"),
    "completion": ("completion", "completion"),
    "check-image": ("firstjob", "check_image"),
    "dev-cluster": ("fsdpjob.orchestrator.devcluster.cli", "dev_cluster"),
}


# `fsdpjob --help` lists the commands in the order a user meets them, in these sections (each command in one).
SECTIONS = (
    ("Start a job", ("init", "quickstart", "validate", "plan", "show", "render", "submit", "sweep")),
    ("Watch it", ("status", "list", "logs", "wait", "report")),
    ("Manage runs", ("cancel", "export", "prune")),
    ("Set up and look up", ("profiles", "check-image", "schema", "completion", "dev-cluster")),
)


class LazyGroup(click.Group):
    """Loads a command's module only when the command is asked for: every command starts faster."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return [name for _, names in SECTIONS for name in names]

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """The commands under their SECTIONS' titles (click's own lists them all in one alphabetical table)."""
        width = max(len(name) for name in COMMANDS)  # one column for every section (write_dl sizes each alone)
        limit = formatter.width - 6 - width
        for title, names in SECTIONS:
            rows = [(name.ljust(width), command.get_short_help_str(limit)) for name in names
                    if (command := self.get_command(ctx, name)) is not None and not command.hidden]
            with formatter.section(title):
                formatter.write_dl(rows)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in COMMANDS:
            return None
        module, function = COMMANDS[name]
        return getattr(importlib.import_module(module if "." in module else f"{__package__}.{module}"), function)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(__version__, prog_name="fsdpjob")
@click.option("--debug", is_flag=True, help="Show tracebacks for errors.")
def cli(debug: bool) -> None:
    """Fine-tune Hugging Face causal LMs with FSDP2 on Slurm (or on this machine with --profile local).

    Start with: fsdpjob quickstart && fsdpjob submit examples/quickstart.yaml --wait
    """


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
    except Exception as exc:  # the last line of defence against tracebacks
        if debug:
            raise
        click.echo(
            f"fsdpjob: internal error: {type(exc).__name__}: {exc} (rerun with --debug for the traceback)", err=True
        )
        sys.exit(1)
    sys.exit(rc if isinstance(rc, int) else 0)
