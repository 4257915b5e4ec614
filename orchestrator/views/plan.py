"""The planner's plain-text report (what `fsdpjob plan` and `submit --dry-run` print)."""

from __future__ import annotations

from fsdpjob.orchestrator.core.jobspec.families import lora_targets
from fsdpjob.orchestrator.core.units import GB, count_text, params_text, size_text, unit_for
from fsdpjob.orchestrator.planner.fit import FitPlan
from fsdpjob.orchestrator.planner.generator import generator_lines
from fsdpjob.orchestrator.planner.interval import advice_lines
from fsdpjob.orchestrator.planner.memory import DeviceMemory, HostMemory, Setup
from fsdpjob.orchestrator.planner.modelshape import ModelShape


def _row(label: str, value: str, note: str = "") -> str:
    return f"  {label:<28} {value:>16}  {note}".rstrip()


def _memory_lines(d: DeviceMemory) -> list[str]:
    unit = unit_for(d.peak)
    where = "GPU" if d.kind == "gpu" else "rank (host RAM of CPU workers)"
    return [
        f"memory per {where}, peak at {d.peak_moment.name}:",
        _row("", unit[0]),
        *(_row(i.name, size_text(i.bytes, unit), i.note) for i in d.breakdown),
        _row("total", f"{size_text(d.peak, unit)} / {size_text(d.budget, unit)}", "FITS" if d.fits else "DOES NOT FIT"),
        "  other moments, on top of params + AdamW: "
        + ", ".join(f"{mo.name} {size_text(mo.bytes, unit)}" for mo in d.moments),
    ] + _allocator_lines(d, unit) + (
        [f"  budget: {size_text(d.budget, unit)} {unit[0]} usable per GPU ({d.budget_note})",
          f"  assumed, not measured: {d.runtime.name.removesuffix(' (assumed)')} {d.runtime.note} "
          "(bench/gpu measures device-used minus reserved)"] if d.kind == "gpu" and d.budget else [])


def _savers_line(u: Setup) -> str:
    """The memory savers the plan counts (the loss and the root as decided: they go to the workers)."""
    ac = ("full" if u.activation_checkpointing else "none" if u.selective_ac is None
          else "selective op" if u.selective_ac == "op" else f"selective every {u.selective_ac}")
    states = "bf16" if u.moment_bytes == 2 else "fp32"
    return (f"savers: activation checkpointing {ac}, loss {'chunked' if u.chunked_loss else 'standard'}, root "
            f"{'in units of its own' if u.separate_root else 'held gathered'}, AdamW states {states}, reduce-scatter "
            f"{'bf16' if u.reduce_bytes == 2 else 'fp32'}{', compiled blocks' if u.compile else ''}")


def _allocator_lines(d: DeviceMemory, unit: tuple) -> list[str]:
    """torch's allocated and reserved peaks (what max_memory_allocated / _reserved report), and on GPUs the reserved
    peak with the other expandable_segments setting."""
    if d.kind != "gpu":
        return []
    slack = f"{d.fragmentation:.0%} slack" + (" (expandable_segments)" if d.fragmentation < d.other_fragmentation
                                               else " (no expandable_segments)")
    other = "without" if d.fragmentation < d.other_fragmentation else "with"
    return [f"  torch peaks: allocated {size_text(d.allocated, unit)}, reserved {size_text(d.reserved, unit)} "
            f"{unit[0]} ({slack}; {other} expandable_segments: reserved {size_text(d.reserved_other, unit)})"]


def _host_lines(h: HostMemory, s: ModelShape, u: Setup) -> list[str]:
    unit = unit_for(max(h.load_rank0, h.load_every_rank, h.training))
    parts = [f"{size_text(h.offloaded_per_rank, unit)} offloaded"] if u.cpu_offload else []
    parts += [f"{size_text(h.staged_per_rank, unit)} async-save staging"] if h.staged_per_rank else []
    per_rank = f"{u.tasks_per_node} x ({' + '.join(parts)}) {unit[0]} + " if parts else ""
    training_note = (f"{per_rank}{u.tasks_per_node} x {size_text(h.process_per_rank, unit)} {unit[0]} process"
                     if u.on_gpu else "")
    return [
        f"host RAM per node ({unit[0]}):",
        _row("load, own shards" if h.own_shards else "load, rank-0 loading",
             f"{size_text(h.load_rank0, unit)} / {size_text(h.budget, unit)}",
             ("each rank reads its own" if h.own_shards else f"full {s.checkpoint_dtype} copy on rank 0")
             + (" + shards" if not u.on_gpu or u.cpu_offload else "")),
        _row("load, every rank loading", size_text(h.load_every_rank, unit), "not used: whole model on every rank"),
        _row("training", size_text(h.training, unit), training_note),
        *([_row("  of it memory tier", size_text(h.memory_tier, unit),
                "checkpoint.memory_interval_steps: snapshot + replica (+ the one in flight) + staging")]
          if h.memory_tier else []),
    ]


def _lora_lines(plan: FitPlan) -> list[str]:
    tr, lora = plan.trainable, plan.setup.lora
    if lora is None:
        return []
    resolved = lora_targets(plan.model.model_type, lora.target_modules)
    targets = resolved if isinstance(resolved, str) else ", ".join(resolved)
    targets = f"{targets} (auto)" if lora.target_modules == "auto" else targets
    saved = f" + modules_to_save {', '.join(lora.modules_to_save)}" if lora.modules_to_save else ""
    return [f"LoRA: r={lora.r} on {targets}{saved}: {params_text(tr.trained)} params train "
            f"({tr.trained / plan.params.total:.2%} of the base), the base is frozen (weights only, not saved)"]


def format_plan(plan: FitPlan) -> str:
    """A readable plain-text report; the CLI prints it as is."""
    s, p, u, d, t = plan.model, plan.params, plan.setup, plan.device, plan.timing
    head = ", lm_head tied" if s.tied else f", lm_head {params_text(p.lm_head)}"
    step = f"~{t.step_s:,.1f} s" if t.step_s is not None else "unknown"
    lines = [
        f"plan for {plan.name}: {s.model_type}, {params_text(p.total)} params "
        f"(embedding {params_text(p.embedding)}, {p.layers} layers x {params_text(p.per_layer)}{head})",
        *_lora_lines(plan),
        f"topology: {count_text(u.nodes, 'node')} x {count_text(u.tasks_per_node, 'task')} = "
        f"{count_text(u.world, 'rank')} on {d.kind.upper()}, shard degree {u.shard_degree}, "
        f"replicate {u.replicate_degree}",
        _savers_line(u),
        "",
        *_memory_lines(d),
        "",
        *_host_lines(plan.host, s, u),
        "",
        f"checkpoint: {t.checkpoint_bytes / GB:,.3g} GB ({'adapters' if u.lora else 'params'} + AdamW), "
        f"save ~{t.save_s:,.0f} s",
        f"step: {step} ({t.flops_per_rank:.3g} FLOP per rank; {t.throughput_note})",
        *([f"step split (grpo): generation ~{t.generation_s:,.2g} s ("
           + ("a lower bound: decoding is memory-bound" if plan.generator is None else "the server's round and sync")
           + f"), training ~{t.step_s - t.generation_s:,.2g} s"] if t.generation_s is not None and t.step_s else []),
        f"signal lead: {t.signal_lead_s} s (needs {t.needed_lead_s} s: 2 steps + agreement + save + requeue + margin)",
    ]
    if u.grad_accum > 1:
        lines.append(
            f"gradient sync: {'once per step' if u.defer_grad_sync else 'every micro-batch'} over {u.grad_accum} "
            + ("micro-batches (unsharded fp32 gradients accumulate in between: counted above)" if u.defer_grad_sync
               else "micro-batches (deferring it to the last would not fit)")
        )
    lines += generator_lines(plan.generator)
    if plan.interval:
        lines += advice_lines(plan.interval)
    if plan.fixes:
        unit = unit_for(max(f.peak for f in plan.fixes))
        room = f"each fits alone{' with 3 % of the GPU left' if plan.device.kind == 'gpu' else ''}"
        lines += ["", f"fixes, cheapest first ({room}):"]
        lines += [f"  --set {' --set '.join(f.change.split())}  -> {size_text(f.peak, unit)} {unit[0]} ({f.why})"
                  for f in plan.fixes]
    lines += ["", *(f"warning: {w}" for w in plan.warnings)] if plan.warnings else []
    lines += ["", f"refused: {plan.refusal}"] if plan.refusal else []
    lines += ["", f"verdict: {plan.verdict}"]
    return "\n".join(lines)
