"""The views of a sweep: its runs' status side by side, `fsdpjob list` grouped by sweep, and `fsdpjob report
SWEEP`: one row per variant (values, steps, final loss, best eval loss and its step, goodput, GPU-hours) ranked
by the best eval loss, with the eval curves in one picture. One scheduler call for all the runs."""

from __future__ import annotations

import html
import io
import math
import time
from dataclasses import dataclass
from pathlib import Path

from fsdpjob.orchestrator.backend import SchedView, backend_for
from fsdpjob.orchestrator.core.errors import FsdpjobError
from fsdpjob.orchestrator.core.runfolder import runlog
from fsdpjob.orchestrator.core.runfolder.ckptlayout import committed_steps
from fsdpjob.orchestrator.core.runfolder.runmeta import checkpoint_root
from fsdpjob.orchestrator.core.runfolder.sidecar import Sidecar
from fsdpjob.orchestrator.registry import JobRecord
from fsdpjob.orchestrator.views.goodput import goodput

from .display import table
from .status import StatusReport, build_report

LIVE = ("PENDING", "RUNNING", "REQUEUED")


def sweep_facts(records: list[JobRecord]) -> dict:
    s = records[0].sweep
    return {"id": s["id"], "name": s["name"], "job_id": s.get("job_id"), "count": s["count"],
            "scheduler": records[0].scheduler, "runs": len(records)}


def _views(records: list[JobRecord]) -> dict[str, SchedView]:
    try:
        return backend_for(records[0].scheduler).views(records)  # one call: the array job's rows cover every task
    except FsdpjobError as exc:
        import sys

        print(f"fsdpjob: warning: scheduler not reachable ({exc}); showing training progress only", file=sys.stderr)
        return {}


def _values(record: JobRecord) -> str:
    return " ".join(f"{k}={v}" for k, v in record.sweep["values"].items())


# --- status SWEEP and list -------------------------------------------------------------------------------------


def sweep_status(records: list[JobRecord]) -> list[StatusReport]:
    views = _views(records)
    return [build_report(r, views.get(r.job_id)) for r in records]


def phase_counts(reports: list[StatusReport]) -> str:
    counts: dict[str, int] = {}
    for r in reports:
        counts[r.phase] = counts.get(r.phase, 0) + 1
    return ", ".join(f"{n} {phase}" for phase, n in sorted(counts.items()))


def status_text(records: list[JobRecord], reports: list[StatusReport]) -> str:
    facts = sweep_facts(records)
    job = f", array job {facts['job_id']}" if facts["job_id"] else ""
    head = (f"sweep {facts['name']} ({facts['id']}{job}): {facts['runs']} of {facts['count']} runs: "
            f"{phase_counts(reports)}")
    rows = [[str(rec.sweep["index"]), _values(rec), r.run_id, r.job_id, r.phase,
             f"{r.step if r.step is not None else '-'}/{r.max_steps}", _num(r.loss), _num(r.eval_loss)]
            for rec, r in zip(records, reports)]
    return head + "\n" + table(["#", "values", "run", "job", "phase", "step", "loss", "eval loss"], rows)


def status_json(records: list[JobRecord], reports: list[StatusReport]) -> dict:
    return {"sweep": sweep_facts(records), "phases": {r.run_id: r.phase for r in reports},
            "runs": [{**r.to_json(), "sweep_index": rec.sweep["index"], "values": rec.sweep["values"]}
                     for rec, r in zip(records, reports)]}


def grouped(records: list[JobRecord], reports: list[StatusReport]) -> list[tuple[str | None, list[StatusReport]]]:
    """`fsdpjob list`'s groups: each sweep's runs together (by index) where its first run would be, plain runs
    alone; (the sweep's heading line or None, its rows)."""
    out: list[tuple[str | None, list[StatusReport]]] = []
    seen: dict[str, list[tuple[JobRecord, StatusReport]]] = {}
    for rec, rep in zip(records, reports):
        if not rec.sweep:
            out.append((None, [rep]))
            continue
        if rec.sweep["id"] not in seen:
            seen[rec.sweep["id"]] = []
            out.append((rec.sweep["id"], []))
        seen[rec.sweep["id"]].append((rec, rep))
    result = []
    for key, rows in out:
        if key is None:
            result.append((None, rows))
            continue
        members = sorted(seen[key], key=lambda p: p[0].sweep["index"])
        recs, reps = [m[0] for m in members], [m[1] for m in members]
        facts = sweep_facts(recs)
        job = f", array job {facts['job_id']}" if facts["job_id"] else ""
        result.append((f"sweep {facts['name']} ({facts['id']}{job}): {phase_counts(reps)}", reps))
    return result


def list_text(records: list[JobRecord], reports: list[StatusReport]) -> str:
    """`fsdpjob list`: a sweep's runs together, indented under its line; other runs as they are."""
    from .display import runs_table

    if not any(r.sweep for r in records):
        return runs_table(reports)
    groups = grouped(records, reports)
    lines = runs_table([rep for _, reps in groups for rep in reps]).splitlines()
    out, i = lines[:1], 1
    for heading, reps in groups:
        if heading:
            out.append(heading)
        out.extend(("  " if heading else "") + line for line in lines[i:i + len(reps)])
        i += len(reps)
    return "\n".join(out)


# --- report SWEEP ---------------------------------------------------------------------------------------------


@dataclass
class VariantRow:
    index: int
    values: dict
    run_id: str
    run_dir: str
    phase: str
    step: int | None
    max_steps: int
    final_loss: float | None
    best_eval_loss: float | None
    best_eval_step: int | None
    goodput: float | None
    unit_hours: float | None  # GPU-hours (CPU rank-hours on CPU profiles: see unit)
    unit: str
    evals: list[tuple[int, float]]
    losses: list[tuple[int, float]]

    def to_json(self) -> dict:
        d = {k: v for k, v in self.__dict__.items() if k not in ("evals", "losses")}
        return {**d, "eval_curve": [list(p) for p in self.evals]}


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def variant_row(record: JobRecord, view: SchedView | None) -> VariantRow:
    status = build_report(record, view)
    events, metrics = runlog.read_events(record.run_dir), runlog.read_metrics(record.run_dir)
    evals = [(m["step"], float(m["eval_loss"])) for m in metrics
             if isinstance(m.get("step"), int) and _finite(m.get("eval_loss"))]
    losses = [(m["step"], float(m["loss"])) for m in metrics
              if isinstance(m.get("step"), int) and _finite(m.get("loss"))]
    best = min(evals, key=lambda p: (p[1], p[0])) if evals else None
    g = None
    if events:
        attempts = list(view.attempts) if view is not None and view.attempts else None
        g = goodput(record, attempts, events, metrics, now=time.time() if status.phase in LIVE else None)
    return VariantRow(
        index=record.sweep["index"], values=record.sweep["values"], run_id=record.run_id, run_dir=record.run_dir,
        phase=status.phase, step=status.step, max_steps=record.max_steps,
        final_loss=losses[-1][1] if losses else None, best_eval_loss=best[1] if best else None,
        best_eval_step=best[0] if best else None, goodput=g.goodput if g else None,
        unit_hours=g.allocated_unit_s / 3600 if g else None, unit=g.unit if g else "GPU", evals=evals, losses=losses)


def ranked(rows: list[VariantRow]) -> list[VariantRow]:
    """Best eval loss first; runs without an evaluation after, by their final training loss, then by index."""
    inf = float("inf")
    return sorted(rows, key=lambda r: (r.best_eval_loss is None, r.best_eval_loss if r.best_eval_loss is not None
                                       else (r.final_loss if r.final_loss is not None else inf), r.index))


def sweep_report(records: list[JobRecord]) -> list[VariantRow]:
    views = _views(records)
    return ranked([variant_row(r, views.get(r.job_id)) for r in records])


def report_json(records: list[JobRecord], rows: list[VariantRow]) -> dict:
    best = rows[0] if rows and rows[0].best_eval_loss is not None else None
    return {"sweep": sweep_facts(records), "ranked": [r.to_json() for r in rows],
            "best": best.run_id if best else None}


def _num(x: float | None, fmt: str = ".4f") -> str:
    return "-" if x is None else format(x, fmt)


def report_text(records: list[JobRecord], rows: list[VariantRow]) -> str:
    facts = sweep_facts(records)
    unit = rows[0].unit if rows else "GPU"
    head = f"sweep {facts['name']} ({facts['id']}): {len(rows)} runs, ranked by best eval loss"
    body = table(
        ["rank", "#", "values", "phase", "steps", "final loss", "best eval", "at step", "goodput", f"{unit}-hours"],
        [[str(i + 1), str(r.index), " ".join(f"{k}={v}" for k, v in r.values.items()), r.phase,
          f"{r.step if r.step is not None else '-'}/{r.max_steps}", _num(r.final_loss), _num(r.best_eval_loss),
          str(r.best_eval_step) if r.best_eval_step is not None else "-",
          "-" if r.goodput is None else f"{100 * r.goodput:.1f} %", _num(r.unit_hours, ".3f")]
         for i, r in enumerate(rows)])
    tail = "" if any(r.best_eval_loss is not None for r in rows) else \
        "\nno run has an eval loss (train.eval_every with eval data): ranked by the final training loss"
    return f"{head}\n{body}{tail}"


def curves_png(records: list[JobRecord], rows: list[VariantRow]) -> bytes:
    """The eval curves of every variant in one picture (the training loss, dashed, where a run has no eval)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 5.5), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    for r in sorted(rows, key=lambda r: r.index):
        label = f"{r.index}: " + " ".join(f"{k}={v}" for k, v in r.values.items())
        if r.evals:
            ax.plot([s for s, _ in r.evals], [v for _, v in r.evals], marker="o", markersize=3, label=label)
        elif r.losses:
            ax.plot([s for s, _ in r.losses], [v for _, v in r.losses], linestyle="--", label=f"{label} (train loss)")
    ax.set_xlabel("step")
    ax.set_ylabel("eval loss")
    ax.set_title(f"sweep {sweep_facts(records)['name']}: eval loss by variant")
    ax.grid(alpha=0.3)
    if rows:
        ax.legend(fontsize=8)
    buf = io.BytesIO()
    fig.canvas.print_png(buf)
    return buf.getvalue()


def report_html(records: list[JobRecord], rows: list[VariantRow], png: bytes) -> str:
    import base64

    text = html.escape(report_text(records, rows))
    image = base64.b64encode(png).decode("ascii")
    title = html.escape(f"sweep {sweep_facts(records)['name']}")
    return (f"<!doctype html><html><head><meta charset=\"utf-8\"><title>{title}</title></head><body>"
            f"<h1>{title}</h1><pre>{text}</pre><img alt=\"eval curves\" src=\"data:image/png;base64,{image}\">"
            "</body></html>\n")


# --- export SWEEP --best ----------------------------------------------------------------------------------------


def best_checkpoint(row: VariantRow) -> tuple[Path, str]:
    """The best variant's checkpoint to export: its committed step with the lowest recorded eval loss (the
    sidecar's, as keep_best keeps it), else its newest committed step; (folder, why this one)."""
    root = checkpoint_root(Path(row.run_dir))
    steps = committed_steps(root) if root.is_dir() else []
    if not steps:
        raise FsdpjobError(f"the best run {row.run_id} has no committed checkpoint in {root}")
    scored = []
    for step, folder in steps:
        try:
            loss = Sidecar.read(folder).eval_loss
        except Exception:  # a damaged sidecar is no candidate; export verifies the folder itself
            continue
        if loss is not None and math.isfinite(loss):
            scored.append((loss, step, folder))
    if scored:
        loss, step, folder = min(scored)
        return folder, f"step {step}, eval loss {loss:.4f} (its lowest among the kept checkpoints)"
    step, folder = steps[-1]
    return folder, f"step {step}, its newest committed checkpoint (none records an eval loss)"
