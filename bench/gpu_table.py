"""bench/gpu.py's summary table: one markdown row per case, and the lines that say what was measured where."""

from __future__ import annotations

import argparse

# gpu.py's --steps; the others --short-steps
LONG_CASES = ("bare", "fsdpjob", "fsdpjob-naive", "fsdpjob-sdpa", "fsdpjob-compile")

HEADER = ("| case | tok/s (target) | / bare | TFLOP/s | MFU nominal / measured peak | alloc / reserved / device MiB "
          "| plan - runtime MiB (vs reserved) | plan MiB (vs device) | device - reserved MiB (plan's runtime) "
          "| host VmHWM MiB (plan) | start-up s | first step s | save s (blocking) | load s "
          "| dynamo graphs / recompiles / breaks | loss first -> last |")  # fmt: skip


def render_table(results: dict[str, dict], args: argparse.Namespace) -> str:
    probe = args.probe
    nominal = f"{probe['nominal_flops'] / 1e12:.0f}" if probe["nominal_flops"] else "unknown"
    shape = "tiny" if args.tiny else "2048 x 24 layers (~1.2B params)"
    lines = [
        f"device   {probe['name']}, torch {probe['torch']} (CUDA {probe['cuda']}); SDPA kernels for the shape: "
        f"{probe['sdpa']}",
        f"peak     nominal dense bf16 {nominal} TFLOP/s; measured {probe['matmul']} matmul "
        f"{probe['matmul_flops'] / 1e12:.1f} TFLOP/s",
        f"model    llama {shape}, bf16 mixed precision, activation checkpointing, fused AdamW",
        f"batch    {args.micro_batch} x {args.seq} tokens per step; {args.steps} steps, the first {args.warmup} "
        f"untimed ({', '.join(c for c in results if c in LONG_CASES)}); {args.short_steps}, the first "
        f"{args.short_warmup} untimed (the others)",
        "",
        HEADER,
        "|" + "---|" * HEADER.count(" | ") + "---|",
    ]
    base = results.get("bare", {}).get("rate")
    for case, r in results.items():
        lines.append(_row(case, r, base))
    return "\n".join(lines)


def _row(case: str, r: dict, base: float | None) -> str:
    if "rate" not in r:
        return f"| {case} | FAILED: {r['error'].splitlines()[0][:200]} |" + " |" * (HEADER.count(" | ") - 1)
    rate = r["rate"]
    target = f" ({_num(r.get('target_rate'))})" if r.get("target_rate") else ""
    ratio = f"{rate / base:.2f}" if base else "-"
    mem = " / ".join(_num(r.get(k)) for k in ("peak_mem_mb", "peak_reserved_mb", "device_used_mb"))
    planned, runtime = r.get("planned_peak_mb"), r.get("planned_runtime_mb")
    without_runtime = planned - runtime if planned is not None and runtime is not None else None
    dynamo = r.get("dynamo") or {}
    compiled = (f"{dynamo['graphs']} / {dynamo['recompiles']} / {dynamo['graph_breaks']}"
                + (f" ({dynamo['recompile_limit_hits']} limit hits)" if dynamo.get("recompile_limit_hits") else "")
                if dynamo.get("frames") else "-")  # fmt: skip
    cells = [
        case, f"{_num(rate)}{target}", ratio, _num(r.get("achieved_tflops"), ".1f"),
        f"{_num(r.get('mfu_nominal'), '.3f')} / {_num(r.get('mfu_measured'), '.3f')}", mem,
        _against(without_runtime, r.get("peak_reserved_mb")), _against(planned, r.get("device_used_mb")),
        f"{_num(r.get('runtime_mb'))} ({_num(runtime)})",
        f"{_num(r.get('vmhwm_mb'))} ({_num(r.get('planned_host_mb'))})",
        _num(r.get("startup_s"), ".1f"), _num(r.get("first_step_s"), ".1f"),
        f"{_num(r.get('save_s'), '.2f')} ({_num(r.get('blocking_s'), '.2f')})", _num(r.get("load_s"), ".2f"),
        compiled, f"{r['losses'][0]:.4f} -> {r['losses'][-1]:.4f}",
    ]  # fmt: skip
    return "| " + " | ".join(cells) + " |"


def _against(planned: float | None, measured: float | None) -> str:
    """The planned figure and its error against the measured one: +x % means the plan is above."""
    if planned is None:
        return "-"
    return f"{planned:.0f} ({planned / measured - 1:+.1%})" if measured else f"{planned:.0f}"


def _num(value: float | None, fmt: str = ".0f") -> str:
    return "-" if value is None else format(value, fmt)
