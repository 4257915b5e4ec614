"""Start estimates before submitting (`plan`, `submit --dry-run`): the scheduler's own guess (the backend's; Slurm's
`sbatch --test-only`) of when the job, and alternative shapes of it (--shapes 2x8,4x8), would start, beside the
planner's step and total time: which finishes first."""

from __future__ import annotations

import re
import time
from dataclasses import dataclass

import click

from fsdpjob.orchestrator.core.errors import FsdpjobError, InputError

# sbatch's line (src/sbatch/sbatch.c, the same from 17.11 to 24.x); the time follows SLURM_TIME_FORMAT (ISO by
# default, but "relative" has spaces), and slurmctld before 18.08 named no partition.
_WILL_RUN = re.compile(r"Job (?P<job>\d+) to start at (?P<start>.+?) using (?P<cpus>\d+) processors on nodes "
                       r"(?P<nodes>\S+)(?: in partition (?P<partition>\S+))?")
# sbatch's words when there is no Slurm to ask (not installed, no configuration, slurmctld down or slow).
_UNREACHABLE = ("not found on PATH", "configuration source", "contact", "timed out", "Connection refused",
                "fetch_config", "DNS SRV")
_SHAPE = re.compile(r"(?P<nodes>[1-9]\d*)x(?P<gpus>\d+)")


@dataclass(frozen=True)
class WillRun:
    start: str  # as Slurm printed it
    start_ts: float | None  # Unix seconds when Slurm printed an ISO time
    cpus: int
    nodes: str
    partition: str | None


def parse_test_only(text: str) -> WillRun | None:
    """sbatch --test-only's stderr -> its estimate; None when it has no such line."""
    m = _WILL_RUN.search(text)
    if m is None:
        return None
    start = m["start"].strip()
    try:
        ts = time.mktime(time.strptime(start, "%Y-%m-%dT%H:%M:%S"))
    except ValueError:
        ts = None
    return WillRun(start=start, start_ts=ts, cpus=int(m["cpus"]), nodes=m["nodes"], partition=m["partition"])


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """``2x8,4x8`` -> [(2, 8), (4, 8)] (nodes, GPUs per node)."""
    shapes = []
    for part in (p.strip() for p in text.split(",")):
        m = _SHAPE.fullmatch(part)
        if m is None:
            raise InputError(f"{part!r} is not a shape; write NODESxGPUS_PER_NODE, e.g. --shapes 2x8,4x8",
                             loc="--shapes")
        shapes.append((int(m["nodes"]), int(m["gpus"])))
    return shapes


def estimate(label: str, request, step_s: float | None, max_steps: int, ask) -> dict:
    """One row: the scheduler's start estimate for ``request`` (``ask``: the backend's, Slurm's sbatch --test-only),
    the planner's step and total time, and the finish that follows. ``error``: why there is no estimate (one line)."""
    total_s = step_s * max_steps if step_s is not None else None
    row = {"shape": label, "start": None, "nodes": None, "partition": None, "step_s": step_s, "total_s": total_s,
           "finish": None, "error": None}
    try:
        will = parse_test_only(ask(request))
    except FsdpjobError as exc:
        why = " ".join(str(exc).split())
        row["error"] = why if len(why) <= 160 else why[:157] + "..."  # one line: Slurm's own errors run long
        return row
    if will is None:
        row["error"] = "sbatch --test-only gave no estimate"
        return row
    row.update(start=will.start, nodes=will.nodes, partition=will.partition)
    if will.start_ts is not None and total_s is not None:
        row["finish"] = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(will.start_ts + total_s))
    return row


def format_estimates(rows: list[dict]) -> list[str]:
    """Lines for a person; the first finish is marked when shapes are compared."""
    if not rows:
        return []
    if all(r["error"] for r in rows):
        return [f"start estimate: none ({rows[0]['error']})"]
    finishes = [r["finish"] for r in rows if r["finish"]]
    first = min(finishes) if len(rows) > 1 and finishes else None
    lines = ["start estimate (Slurm's sbatch --test-only; the planner's step time):"]
    for r in rows:
        if r["error"]:
            lines.append(f"  {r['shape']:<8} no estimate: {r['error']}")
            continue
        step = f"{r['step_s']:.2f} s/step" if r["step_s"] is not None else "step time unknown"
        total = f"total {_duration(r['total_s'])}" if r["total_s"] is not None else ""
        finish = f"-> finish {r['finish']}" if r["finish"] else ""
        mark = "  (finishes first)" if first and r["finish"] == first else ""
        lines.append(" ".join(x for x in (f"  {r['shape']:<8} start {r['start']} on {r['nodes']}"
                                          f"{' (' + r['partition'] + ')' if r['partition'] else ''},",
                                          step + ",", total, finish) if x).rstrip(",") + mark)
    return lines


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    h, rest = divmod(seconds, 3600)
    return f"{h}h{rest // 60:02d}m" if h else f"{rest // 60}m{rest % 60:02d}s"


def start_estimates(job, fit, shapes_text: str | None, shaped) -> list[dict]:
    """Rows for the job as asked and for each --shapes alternative; ``shaped(nodes, gpus)`` loads and plans the
    job in another shape (-> (job, fit)). Empty where the scheduler gives no estimates (nothing to wait for)."""
    from fsdpjob.orchestrator.backend import START_ESTIMATES, backend_for, dry_run

    backend = backend_for(job.profile.scheduler)
    if refused := backend.refusal(START_ESTIMATES):
        if shapes_text:
            raise refused.for_option("--shapes")
        return []
    ask = _asker(backend)
    asked = (job.eff.nodes, job.eff.gpus_per_node or 0)
    rows = [estimate(f"{asked[0]}x{asked[1]}", dry_run(job), fit.timing.step_s, job.spec.train.max_steps, ask)]
    for nodes, gpus in parse_shapes(shapes_text) if shapes_text else []:
        if (nodes, gpus) == asked:
            continue
        other, other_fit = shaped(nodes, gpus)
        rows.append(estimate(f"{nodes}x{gpus}", dry_run(other), other_fit.timing.step_s,
                             other.spec.train.max_steps, ask))
    return rows


def _asker(backend):
    """The backend's start estimate of a request, asked until the scheduler proves unreachable (then the others
    would only wait for the same answer: they get its one line at once)."""
    failed: list[str] = []

    def ask(request) -> str:
        if failed:
            raise FsdpjobError(failed[0])
        try:
            return backend.start_estimate(request)
        except FsdpjobError as exc:
            if any(word in str(exc) for word in _UNREACHABLE):
                # sbatch's own lines (config look-ups, DNS) say little to a user: name the situation instead
                failed.append(" ".join(str(exc).split()) if "not found on PATH" in str(exc) else
                              "no Slurm controller reachable from here: sbatch --test-only failed")
                raise FsdpjobError(failed[0]) from None
            raise

    return ask


def start_estimates_for(job, fit, spec: str, profile: str | None, sets: tuple[str, ...], shapes: str | None,
                        ) -> list[dict]:
    """The rows for the job and for each of --shapes, each shape loaded and planned from the same spec and --set."""
    from dataclasses import replace

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


def echo_estimates(rows: list[dict], *, err: bool) -> None:
    """The start estimates for a person (one line when the scheduler could not be asked)."""
    for line in format_estimates(rows):
        click.echo(line, err=err)
