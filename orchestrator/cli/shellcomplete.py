"""Shell completion for click's ``shell_complete=``: run ids (and their prefixes), Slurm job ids and profile names."""

from __future__ import annotations

import click
from click.shell_completion import CompletionItem

from fsdpjob.orchestrator.core.errors import FsdpjobError


def complete_runs(ctx: click.Context, param: click.Parameter, incomplete: str) -> list[CompletionItem]:
    """The registry's run ids, newest first, then job ids, that start with what was typed."""
    from fsdpjob.orchestrator import registry

    records = list(reversed(registry.all_records()))
    items = [CompletionItem(r.run_id, help=f"job {r.job_id}, {r.profile}") for r in records
             if r.run_id.startswith(incomplete)]
    items += [CompletionItem(r.job_id, help=r.run_id) for r in records
              if r.job_id.startswith(incomplete) and incomplete]  # job ids only once a digit is typed
    return items


def complete_profiles(ctx: click.Context, param: click.Parameter, incomplete: str) -> list[CompletionItem]:
    """Profile names (shipped and $FSDPJOB_PROFILES), or files when a path is being typed."""
    from fsdpjob.orchestrator.core.jobspec.profiles import available_profiles

    if "/" in incomplete:
        return [CompletionItem(incomplete, type="file")]
    try:
        names = available_profiles()
    except (OSError, FsdpjobError):
        return []
    return [CompletionItem(name) for name in names if name.startswith(incomplete)]
