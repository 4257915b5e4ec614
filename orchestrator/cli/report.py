"""`fsdpjob report`: a run's goodput (where its GPU-seconds went), or a sweep's variants ranked; as text, JSON, a
PNG (--plot) or one HTML page (--html)."""

from __future__ import annotations

from pathlib import Path

import click

from fsdpjob.orchestrator.core.errors import InputError

from .options import JSON_OPT, RUN_ARG, command, echo_json


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


@command()
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
    from fsdpjob.orchestrator.views.report import plot
    from fsdpjob.orchestrator.views.report.run import format_report, run_report

    if plot_file is not None and html_file is not None and plot_file.resolve() == html_file.resolve():
        # Both are written, the page last: the PNG would be lost without a word.
        raise InputError(f"{html_file} is also --plot's file; give the page and the picture two files", loc="--html")
    for option, path in (("--plot", plot_file), ("--html", html_file)):
        if path is not None:
            _output_file(option, path)
            if not plot.available():
                click.echo(f"fsdpjob: {option} needs matplotlib: {plot.INSTALL_HINT}", err=True)
                raise SystemExit(2)
    if tasks := registry.sweep_records(run):
        _sweep_report(tasks, as_json, plot_file, html_file)
        return
    record = registry.find(run)
    result = run_report(record)
    for warning in result.warnings:
        click.echo(f"warning: {warning}", err=True)
    data = result.to_json()
    png = plot.run_png(data, record.run_dir) if plot_file or html_file else b""
    if plot_file is not None:
        _write_output("--plot", plot_file, png)
    if html_file is not None:
        from fsdpjob.orchestrator.views.report.html import page

        _write_output("--html", html_file, page(result, png, record.scheduler).encode("utf-8"))
    if as_json:
        echo_json(data)
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
        echo_json(sweepview.report_json(tasks, rows))
    else:
        click.echo(sweepview.report_text(tasks, rows))
