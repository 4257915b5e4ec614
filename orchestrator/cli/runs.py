"""The commands around a recorded run: status, list, wait, logs and cancel (of a run, or of a whole sweep)."""

from __future__ import annotations

from pathlib import Path

import click

from fsdpjob.orchestrator.core.errors import FsdpjobError

from .options import INTERVAL_OPT, JSON_OPT, RUN_ARG, WATCH_OPT, command, echo_json, watch_is_text
from .shellcomplete import complete_runs


@command()
@click.argument("run", required=False, shell_complete=complete_runs)
@JSON_OPT
@WATCH_OPT
@INTERVAL_OPT
def status(run: str | None, as_json: bool, watch: bool, interval: float) -> None:
    """Status of a run (default: the newest): scheduler state joined with training progress."""
    from fsdpjob.orchestrator import registry
    from fsdpjob.orchestrator.views.display import status_text
    from fsdpjob.orchestrator.views.status import report_for

    watch_is_text(watch, as_json)
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
        echo_json(report.to_json())
        return
    click.echo(status_text(report))


@command(name="list")
@JSON_OPT
@WATCH_OPT
@INTERVAL_OPT
def list_runs(as_json: bool, watch: bool, interval: float) -> None:
    """All runs in the registry, with one scheduler call."""
    from fsdpjob.orchestrator import registry
    from fsdpjob.orchestrator.views.status import reports

    watch_is_text(watch, as_json)
    if watch:
        from fsdpjob.orchestrator.views.watch import watch as watch_view

        watch_view(lambda: (_runs_list(registry.all_records()), False), interval)
        return
    records = registry.all_records()
    rows = reports(records)
    if as_json:
        echo_json([{**r.to_json(), "sweep": rec.sweep} for rec, r in zip(records, rows)])
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
        echo_json(sweepview.status_json(tasks, now))
    else:
        click.echo(sweepview.status_text(tasks, now))


@command()
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


@command()
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
    from fsdpjob.orchestrator.views.follow import TERMINAL
    from fsdpjob.orchestrator.views.status import report_for

    if (phase := report_for(record).phase) in TERMINAL:  # nothing to stop: what the user wanted is so
        click.echo(f"{record.run_id} (job {record.job_id}) already ended ({phase}); nothing to cancel")
        return
    how = cancel_run(record)
    click.echo(f"cancelled {record.run_id} (job {record.job_id}): {how}")


@command(name="wait")
@RUN_ARG
def wait_run(run: str) -> None:
    """Re-attach to a run's progress stream (as submit --wait shows it); exit 0 if it completes, else 1.

    Ctrl-C detaches: the run goes on."""
    from fsdpjob.orchestrator import registry
    from fsdpjob.orchestrator.views.follow import wait_for

    raise SystemExit(wait_for(registry.find(run)))
