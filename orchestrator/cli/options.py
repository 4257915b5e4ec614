"""What several commands share: their options (one definition each), the command class, JSON output, and the
questions plan, submit and sweep all ask (the partition's size, whether the plan refuses)."""

from __future__ import annotations

import functools
import json

import click

from fsdpjob.orchestrator.core.errors import InputError, PlanRefused

from .shellcomplete import complete_profiles, complete_runs


class Command(click.Command):
    """A command whose line in `fsdpjob --help` shows its docstring's whole first sentence (click would cut it
    at the terminal's width; the help's table wraps it instead)."""

    def get_short_help_str(self, limit: int = 45) -> str:
        return super().get_short_help_str(limit=10_000)


command = functools.partial(click.command, cls=Command)  # every fsdpjob command is made with this

SPEC_ARG = click.argument("spec", type=click.Path(dir_okay=False, path_type=str))


def profile_option(*, default: str | None = None, what: str = "Cluster profile name or YAML path (overrides the "
                   "spec's profile).") -> click.Option:
    """--profile/-p, completed from the profiles' names (init's has a default and its own help)."""
    return click.option("--profile", "-p", default=default, show_default=default is not None,
                        shell_complete=complete_profiles, help=what)


PROFILE_OPT = profile_option()
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
NO_FILE_CHECKS_OPT = click.option(
    "--no-file-checks", is_flag=True,
    help="Skip checks of the model folder and data file (the environment is still checked).",
)


def echo_json(data: object) -> None:
    click.echo(json.dumps(data, indent=2, sort_keys=True, default=str))


def watch_is_text(watch: bool, as_json: bool) -> None:
    if watch and as_json:
        raise InputError("redraws text for a person; drop --json, or poll `--json` from a script", file="--watch")


def partition_size(kind: str, partition: str | None):
    """What validate, plan and submit ask the profile's scheduler (one sinfo call on Slurm): how many nodes the
    job's partition has; nothing is refused when the scheduler cannot be reached from here."""
    from fsdpjob.orchestrator.backend import backend_for

    return backend_for(kind).partition_size(partition)


def refusal(fit, spec: str, *, force: bool) -> PlanRefused | None:
    """Why submit would not submit this plan (FitPlan.verdict), or None: plan, submit --dry-run and submit
    all ask this one question, so they agree on the verdict and the exit code."""
    if force or fit.verdict == "FITS":
        return None
    if fit.verdict == "REFUSED":
        return PlanRefused(f"{spec}: {fit.refusal} (or pass --force)")
    return PlanRefused("the planner says this job does not fit (see the plan above); apply a fix or pass --force")
