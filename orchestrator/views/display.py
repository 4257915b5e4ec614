"""Plain-text tables for the terminal (rich when stdout is a terminal, aligned columns otherwise)."""

from __future__ import annotations

import sys

from fsdpjob.orchestrator.core.units import amount_text


def table(headers: list[str], rows: list[list[str]]) -> str:
    if sys.stdout.isatty():
        from io import StringIO

        from rich.console import Console
        from rich.table import Table

        t = Table(*headers, box=None, pad_edge=False, header_style="bold")
        for row in rows:
            t.add_row(*[str(c) for c in row])
        buf = StringIO()
        Console(file=buf, force_terminal=True, width=200).print(t)
        return buf.getvalue().rstrip("\n")
    widths = [max(len(str(x)) for x in col) for col in zip(headers, *rows)] if rows else [len(h) for h in headers]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip() for r in [headers, *rows]]
    return "\n".join(lines)


def runs_table(rows) -> str:
    """`fsdpjob list` for a person: one StatusReport per row."""
    return table(
        ["run", "job", "phase", "step", "loss", "ckpt", "restarts", "profile"],
        [
            [r.run_id, r.job_id, r.phase, f"{r.step if r.step is not None else '-'}/{r.max_steps}",
             f"{r.loss:.4f}" if r.loss is not None else "-",
             str(r.last_checkpoint_step) if r.last_checkpoint_step is not None else "-", str(r.restarts), r.profile]
            for r in rows
        ],
    )


def status_text(r) -> str:
    """`fsdpjob status` for a person: one StatusReport (views/status.py) as labelled lines."""
    from .status import format_eta

    lines = [
        f"run        {r.run_id}  ({r.scheduler} job {r.job_id}, profile {r.profile})",
        f"phase      {r.phase}  (scheduler: {r.scheduler_state}{', ' + r.reason if r.reason else ''})",
        f"progress   step {r.step if r.step is not None else '-'}/{r.max_steps}"
        + (f"  loss {r.loss:.4f}" if r.loss is not None else "")
        + (f"  eval loss {r.eval_loss:.4f}" if r.eval_loss is not None else "")
        + (f"  reward {r.reward:.4f}" if r.reward is not None else "")
        + (f"  {r.tokens_per_s:.0f} tok/s" if r.tokens_per_s else "")
        + f"  eta {format_eta(r.eta_s)}",
        f"checkpoint last committed step {r.last_checkpoint_step if r.last_checkpoint_step is not None else '-'}",
        f"restarts   {r.restarts}  (steps lost to interruptions: {r.steps_lost})"
        + (f"  last stop: {r.last_stop['reason']} at step {r.last_stop['step']}" if r.last_stop else ""),
        goodput_line(r.goodput, r.run_id),
        *recovery_lines(r.recovery, r.run_id),
        *data_lines(r.data),
        *lineage_lines(r.resumed_from),
        *([f"after      {r.after['message']}"] if r.after else []),
        f"nodes      {r.nodes or '-'}  (world size {r.world_size})",
        f"folder     {r.run_dir}",
    ]
    if r.failure_reason:
        lines.append(f"failure    {r.failure_reason}")
    return "\n".join(lines)


def lineage_lines(source: dict | None) -> list[str]:
    """Where the run started from: its --resume-from, and the run that wrote that checkpoint."""
    if not source:
        return []
    return [f"resumed    from {source['path']}" + (f"  (run {source['run_id']})" if source["run_id"] else "")]


def data_lines(data: dict | None) -> list[str]:
    """The training data as packed: examples, sequences, packing efficiency and what the long examples became."""
    if not data:
        return []
    long = ", ".join(f"{data[k]} {k}" for k in ("truncated", "split", "dropped") if data.get(k))
    efficiency = data.get("packing_efficiency")
    return [f"data       {data.get('examples')} examples in {data.get('sequences')} sequences"
            + (f", {efficiency:.1%} real tokens" if efficiency is not None else "")
            + (f"; longer than seq_len: {long}" if long else "")]


def recovery_lines(rec: dict | None, run_id: str) -> list[str]:
    """The in-allocation supervisor's part: restarts here, the last fault, where each rank was when it hung."""
    if not rec:
        return []
    last = rec["last_fault"]
    lines = [f"recovery   {rec['restarts']} restart(s) inside the allocation; last fault: {last.get('kind')}: "
             f"{last.get('reason')}"]
    if rec["excluded_nodes"]:
        lines.append(f"           excluded nodes: {', '.join(rec['excluded_nodes'])}")
    for rank, frame in sorted((last.get("top_frames") or {}).items(), key=lambda kv: int(kv[0])):
        lines.append(f"           rank {rank}: {frame or '?'}")
    if last.get("stacks"):
        lines.append(f"           stacks: fsdpjob logs {run_id} --stacks")
    return lines


def goodput_line(g: dict | None, run_id: str) -> str:
    if not g or g["goodput"] is None:
        return "goodput    -"
    return (f"goodput    {100 * g['goodput']:.1f} % of {amount_text(g['allocated_unit_s'])} {g['unit']}-seconds "
            f"allocated  (ETTR {100 * (g['ettr'] or 0):.1f} %; breakdown: fsdpjob report {run_id})")
