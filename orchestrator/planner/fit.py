"""Preflight planner: parameter count from config.json, per-rank and per-node memory, checkpoint and step time.

Pure arithmetic on the login node: reads the model folder's ``config.json`` only (never weights) and imports
neither torch nor transformers. ``make_plan(resolved)`` returns a :class:`FitPlan`; ``views/plan.format_plan``
renders it as a text table and ``FitPlan.to_json()`` as a dict with stable keys (documented on the method). The
model's shape and parameter count come from ``modelshape.py``, the memory model from ``memory.py`` and the
step and save times from ``timing.py``; this module puts them together into a plan and finds the fixes.

The golden seed case (Llama-2-70B, 68.98e9 params, fp32 master weights, bf16 compute, AC, seq 2048, mb 1):
  * 2 nodes x 8 A100-80GB: params + grads + AdamW = 16 B x 68.98e9 / 16 = 69.0e9 B (64.2 GiB); the first layer's
    backward (every other layer's sharded gradients held, its own transients) with the CUDA runtime and 5 %
    fragmentation peaks at ~79.7 GiB > the 79.1 GiB torch can allocate: DOES NOT FIT (examples/ uses 3 nodes).
  * 1 node x 8: 16 B x 68.98e9 / 8 = 138e9 B (128.5 GiB) of state alone: does not fit; CPU offload (15 GiB left
    on the GPU, 1.0 TiB of host RAM per node) or a third node fix it.
  * host RAM at load: every rank loading fp32 = 8 x 4 B x 68.98e9 = 2.2e12 B per node, more than a 2 TB node;
    rank-0 loading = one fp16 copy (the checkpoint's dtype) = 0.14e12 B. (Counting each rank's fp32 shard in
    host RAM too gives 0.28e12 B; the worker materializes the shards on the GPUs, so they are not counted there.)
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from fsdpjob.orchestrator.core import envvars, hostcpu
from fsdpjob.orchestrator.core.jobspec.families import attention_for
from fsdpjob.orchestrator.core.jobspec.methods import facts_of
from fsdpjob.orchestrator.core.jobspec.profiles import ClusterProfile
from fsdpjob.orchestrator.core.jobspec.spec import JobSpec
from fsdpjob.orchestrator.core.stopping import AGREE_EVERY_S, STEPS_BEFORE_STOP
from fsdpjob.orchestrator.core.units import GiB

from .generator import GeneratorPlan, plan_generator, takes_nodes
from .interval import IntervalAdvice, advise, current_interval
from .lora import Trainable, quantize_problem, trainable
from .memory import DTYPE_BYTES, DeviceMemory, HostMemory, Setup, device_memory, host_memory
from .modelshape import ModelShape, ParamCount, count_params, read_model_shape
from .resolve import Effective, Resolved
from .savers import decide_savers, expandable_segments, saver_fixes
from .timing import Timing, plan_timing, setup_work_s


@dataclass(frozen=True)
class Fix:
    change: str  # spec overrides, as `--set` takes them
    peak: int  # per-rank device peak after the change
    saves: int  # device bytes saved per rank (negative: more)
    why: str


@dataclass(frozen=True)
class FitPlan:
    """Does the job fit: memory and time per rank, and the fixes. The other two plans are the sbatch
    payload (slurm/render.SbatchParts) and the facts the workers take from this one (spec.json's worker_facts)."""

    name: str
    model: ModelShape
    params: ParamCount
    setup: Setup
    device: DeviceMemory
    host: HostMemory
    timing: Timing
    fixes: tuple[Fix, ...] = ()
    warnings: tuple[str, ...] = field(default_factory=tuple)
    interval: IntervalAdvice | None = None  # with the profile's expected_interruptions_per_day
    refusal: str | None = None  # a spec setting the plan's own figures contradict (submit refuses it)
    generator: GeneratorPlan | None = None  # grpo's generation server (generator.py); None: in-process or not grpo
    setup_s: float = 0.0  # a first start's weight read and tokenization (timing.setup_work_s)

    @property
    def fits(self) -> bool:
        return self.device.fits and self.host.fits

    @property
    def verdict(self) -> str:
        """The one verdict `plan`, `submit --dry-run` and `submit` all act on: FITS is the only one that goes."""
        return "DOES NOT FIT" if not self.fits else "REFUSED" if self.refusal else "FITS"

    @property
    def trainable(self) -> Trainable:
        return trainable(self.model, self.params, self.setup.lora, self.setup.quantize)

    def worker_facts(self) -> dict:
        """What the batch side takes from the plan (spec.json "worker_facts"): decisions that depend on memory,
        and the planned step and save times, which bound the first step and save before any is measured."""
        return {"defer_grad_sync": self.setup.defer_grad_sync, "planned_step_s": self.timing.step_s,
                "planned_save_s": self.timing.save_s, "loss": "chunked" if self.setup.chunked_loss else "standard",
                "separate_root": self.setup.separate_root, "planned_setup_s": self.setup_s}

    def to_json(self) -> dict[str, Any]:
        """Stable keys; sizes in bytes, times in seconds, null where unknown.

        - verdict: "FITS" | "DOES NOT FIT" | "REFUSED" (what submit does: only FITS is submitted without --force)
        - fits: bool; refusal: null, or why submit refuses a recovery bound the plan's step or save would cross
        - model: model_type, vocab, hidden, intermediate, layers, heads, kv_heads, head_dim, tied, qkv_bias, o_bias,
          mlp_bias, qk_norm, checkpoint_dtype
        - params: total, embedding, per_layer, attention_per_layer, mlp_per_layer, norms_per_layer, layers,
          final_norm, lm_head, trainable (= total without model.lora), added (parameters LoRA adds: adapters and
          modules_to_save's trained copies; 0 without it)
        - topology: nodes, tasks_per_node, world_size, shard_degree, replicate_degree, device ("gpu" | "cpu")
        - device_memory (per rank): kind, budget_bytes (on GPUs what torch can allocate, not the nominal size),
          budget_note (where it comes from), peak_bytes, peak_moment, fits, breakdown [{name, bytes, note}] (sums
          to peak_bytes; on GPUs "CUDA runtime (assumed)" is an estimate), moments {name: bytes on top of the state}
        - host_memory (per node): budget_bytes, load_rank0_bytes (at load, on rank 0's node), load_every_rank_bytes,
          training_bytes, offloaded_per_rank_bytes, fits, own_shards (each rank reads only its own weight shards)
        - checkpoint: bytes, save_s; step: seconds, flops_per_rank, flops_per_s_per_rank, communication_s, assumption
        - signal: lead_s, needed_s
        - step_plan: defer_grad_sync (micro-batches before the last skip the reduce-scatter; the worker follows it),
          planned_step_s, planned_save_s, loss ("standard" | "chunked": train.loss decided), separate_root (bool:
          fsdp.separate_root decided), planned_setup_s (a first start's weight read and tokenization: the supervisor's
          first setup bound); the workers follow these
        - device_memory also has allocated_bytes and reserved_bytes (torch's max_memory_allocated / _reserved at the
          peak), reserved_other_bytes (with the other expandable_segments setting; null on CPU) and
          expandable_segments
        - fixes [{change, peak_bytes, saves_bytes, why}], cheapest first; warnings [str]
        - checkpoint_interval: null, or (profile's expected_interruptions_per_day) save_s, mtbi_s, optimal_s,
          current_s, current_note, lost_per_hour_optimal_s, lost_per_hour_current_s (Young/Daly)
        - generator: null, or grpo's generation server (GeneratorPlan.to_json); topology then counts the trainers
        """
        p, d, h, t, u = self.params, self.device, self.host, self.timing, self.setup
        return {
            "verdict": self.verdict,
            "fits": self.fits,
            "refusal": self.refusal,
            "model": asdict(self.model),
            "params": {
                "total": p.total, "embedding": p.embedding, "per_layer": p.per_layer,
                "attention_per_layer": p.attention, "mlp_per_layer": p.mlp, "norms_per_layer": p.norms,
                "layers": p.layers, "final_norm": p.final_norm, "lm_head": p.lm_head,
                "trainable": self.trainable.trained, "added": self.trainable.weights - p.total,
            },
            "topology": {
                "nodes": u.nodes, "tasks_per_node": u.tasks_per_node, "world_size": u.world,
                "shard_degree": u.shard_degree, "replicate_degree": u.replicate_degree, "device": d.kind,
            },
            "device_memory": {
                "kind": d.kind, "budget_bytes": d.budget, "budget_note": d.budget_note, "peak_bytes": d.peak,
                "peak_moment": d.peak_moment.name, "allocated_bytes": d.allocated, "reserved_bytes": d.reserved,
                "reserved_other_bytes": d.reserved_other, "expandable_segments": u.expandable_segments,
                "fits": d.fits, "breakdown": [asdict(i) for i in d.breakdown],
                "moments": {mo.name: mo.bytes for mo in d.moments},
            },
            "host_memory": {
                "budget_bytes": h.budget, "load_rank0_bytes": h.load_rank0, "load_every_rank_bytes": h.load_every_rank,
                "training_bytes": h.training, "offloaded_per_rank_bytes": h.offloaded_per_rank, "fits": h.fits,
                "own_shards": h.own_shards, "memory_tier_bytes": h.memory_tier,
            },
            "checkpoint": {"bytes": t.checkpoint_bytes, "save_s": t.save_s},
            "step": {"seconds": t.step_s, "generation_s": t.generation_s, "flops_per_rank": t.flops_per_rank,
                     "flops_per_s_per_rank": t.flops_per_s,
                     "communication_s": t.comm_s, "assumption": t.throughput_note},
            "signal": {"lead_s": t.signal_lead_s, "needed_s": t.needed_lead_s},
            "step_plan": self.worker_facts(),
            "fixes": [
                {"change": f.change, "peak_bytes": f.peak, "saves_bytes": f.saves, "why": f.why} for f in self.fixes
            ],
            "warnings": list(self.warnings),
            "checkpoint_interval": self.interval.to_json() if self.interval else None,
            "generator": self.generator.to_json() if self.generator else None,
        }


def _setup(spec: JobSpec, eff: Effective, shape: ModelShape, profile: ClusterProfile) -> Setup:
    on_gpu = eff.gpus_per_node > 0
    ac = spec.model.activation_checkpointing
    # Boundary-aware packing: each example attends to itself only; a preference method's rows are never packed.
    method = facts_of(spec.train.method)
    packed = spec.data.packing is True and method.packs
    options = spec.method_options
    return Setup(
        nodes=eff.nodes - takes_nodes(spec, profile),  # the trainers' (a generation server's nodes do not train)
        generator_nodes=takes_nodes(spec, profile),
        tasks_per_node=eff.tasks_per_node,
        replicate_degree=spec.fsdp.replicate_degree,
        on_gpu=on_gpu,
        model_bytes=DTYPE_BYTES[spec.model.dtype],
        compute_bytes=2 if spec.fsdp.mixed_precision == "bf16" else 4,
        seq_len=spec.data.seq_len,
        micro_batch=spec.train.micro_batch_size,
        grad_accum=spec.train.grad_accum_steps,
        activation_checkpointing=ac == "full",
        selective_ac=spec.model.selective_ac if ac == "selective" else None,
        chunked_loss=spec.train.loss == "chunked",  # auto: decided by make_plan
        state_bytes=2 if spec.train.optimizer_state_dtype == "bfloat16" else 0,
        reduce_bytes=DTYPE_BYTES[spec.fsdp.reduce_dtype],
        separate_root=spec.fsdp.separate_root is True,  # auto: decided by make_plan
        compile=spec.model.compile and on_gpu,  # inductor's partitioner; the CPU tests' aot_eager keeps all
        expandable_segments=expandable_segments({**profile.env, **spec.env}),
        # What the worker will run (jobs/model/build.resolve_attention, by the same rule).
        attn=attention_for(shape.model_type, spec.model.attn_implementation, on_gpu=on_gpu, packed=packed,
                           half=spec.fsdp.mixed_precision == "bf16", windowed=shape.windowed),
        packed=packed,
        cpu_offload=spec.fsdp.cpu_offload and on_gpu,  # on CPU workers everything already lives on the host
        reshard=spec.fsdp.reshard_after_forward,
        lora=spec.model.lora,
        quantize=spec.model.quantize,
        async_save=spec.checkpoint.async_save,
        memory_tier=bool(spec.checkpoint.memory_interval_steps),
        onednn_bf16=not on_gpu and hostcpu.onednn_bf16(),
        rows_per_example=method.rows_per_example,
        reference_copy=method.reference_copy(options) and spec.model.lora is None,
        generation_rows=(spec.train.micro_batch_size * spec.train.grad_accum_steps
                         if method.generates and spec.grpo.generator.backend == "inprocess" else 0),
        generation_tokens=spec.grpo.max_new_tokens if spec.grpo else 0,
        generation_group=spec.grpo.num_generations if spec.grpo else 0,
    )


def _fits(s: ModelShape, p: ParamCount, u: Setup, profile: ClusterProfile, room: float = 0.0) -> tuple[bool, int]:
    """Whether ``u`` fits with ``room`` (a fraction of the GPU's usable memory) left over, and its device peak."""
    dev = device_memory(s, p, u, profile)
    roomy = dev.budget is None or dev.kind != "gpu" or dev.peak <= (1 - room) * dev.budget
    return dev.fits and roomy and host_memory(s, p, u, profile, dev).fits, dev.peak


def tight(dev: DeviceMemory) -> bool:
    """Fits on a GPU with less than HEADROOM left: the runtime term (measured +14-17 % over its assumption on one
    GPU) and NCCL's buffers at 8-16 ranks (unmeasured) can take more than that, so the plan offers its fixes."""
    return dev.fits and dev.kind == "gpu" and dev.budget is not None and dev.budget - dev.peak < HEADROOM * dev.budget


def _fixes(s: ModelShape, p: ParamCount, u: Setup, profile: ClusterProfile, peak: int,
           env: dict[str, str] | None = None, method: str = "dpo", room: float = 0.0) -> list[Fix]:
    """Single changes that make the plan fit (with ``room`` left: a plan that fits too tightly), cheapest first;
    each one has been planned and fits (and is not refused: no CPU offload where rank 0 would broadcast the
    weights over gloo)."""
    out: list[Fix] = []

    def fits(new: Setup) -> tuple[bool, int]:
        return _fits(s, p, new, profile, room)

    def consider(change: str, new: Setup, why: str) -> bool:
        ok, new_peak = fits(new)
        if ok:
            out.append(Fix(change, new_peak, peak - new_peak, why))
        return ok

    for change, new, why in saver_fixes(s, p, u, profile, method):
        consider(change, new, why)
    ac = replace(u, activation_checkpointing=True, selective_ac=None)
    if not u.activation_checkpointing:
        consider("model.activation_checkpointing=true", ac, "recompute layers in backward: ~30% more compute")
    # A smaller micro-batch alone, else together with AC (only when neither alone was enough).
    for base, prefix in ((u, ""), (ac, "model.activation_checkpointing=true ")):
        if base is ac and (u.activation_checkpointing or out):
            break

        def smaller(mb: int, base: Setup = base) -> Setup:
            return replace(base, micro_batch=mb, grad_accum=math.ceil(u.micro_batch * u.grad_accum / mb))

        # Memory falls with the micro-batch: the largest one below the spec's that fits, by bisection.
        # grpo: a rank's completions per step stay whole groups (the micro-batch divides them; validate checks it).
        sizes = [m for m in range(u.micro_batch - 1, 0, -1)
                 if not u.generation_group or (u.micro_batch * u.grad_accum) % m == 0]
        mb = _boundary(sizes, lambda m: fits(smaller(m))[0])
        if mb is not None:
            new = smaller(mb)
            consider(f"{prefix}train.micro_batch_size={mb} train.grad_accum_steps={new.grad_accum}", new,
                     "same global batch, more micro-steps")
            break
    if u.reference_copy and facts_of(method).reference == "beta":
        consider(f"{method}.beta=0", replace(u, reference_copy=False), "no KL term: no reference model (TRL's default)")
    elif u.reference_copy:
        consider(f"{method}.reference=cached", replace(u, reference_copy=False),
                 "the reference's log-probabilities computed once before training and kept on disk: no second "
                 "model in memory")
    if u.model_bytes > 2:
        # The seed recipe's own choice (Llama 2 70B with FSDP kept its weights in bf16): half the sharded state,
        # no slower step. Offered after the changes that cost nothing in accuracy.
        consider("model.dtype=bfloat16", replace(u, model_bytes=2), BF16_BASE if u.lora else BF16_WEIGHTS_COST)
    offloaded = replace(u, cpu_offload=True)
    # The spec refuses offload with HSDP; the plan refuses it where rank 0 would broadcast the weights over gloo.
    if (u.on_gpu and not u.cpu_offload and u.replicate_degree == 1
            and not offload_broadcast_conflict(s, p, offloaded, env or {})):
        consider("fsdp.cpu_offload=true", offloaded, "state on the host: steps much slower")
    if profile.max_nodes is None or profile.max_nodes > u.nodes + u.generator_nodes:
        most = profile.max_nodes - u.generator_nodes if profile.max_nodes else max(4 * u.nodes, u.nodes + 64)
        # Node counts whose world size the replicate degree divides, the fewest that fits by bisection
        # (memory per rank falls as nodes are added).
        step = u.replicate_degree // math.gcd(u.replicate_degree, u.tasks_per_node)
        first = u.nodes + 1 + (-(u.nodes + 1) % step)
        nodes = _boundary(range(first, most + 1, step), lambda n: fits(replace(u, nodes=n))[0])
        if nodes is not None:
            more = replace(u, nodes=nodes)
            consider(f"resources.nodes={nodes + u.generator_nodes}", more,
                     f"shard over {more.shard_degree} ranks: the fewest nodes that fit")
    return out


# What bf16 master weights cost (in the fix's "why"): AdamW updates smaller than bf16's 8-bit mantissa can resolve
# round away, so long runs at small learning rates can drift from an fp32 run.
BF16_WEIGHTS_COST = ("bf16 master weights, gradients and AdamW state: half the state, no slower; updates below "
                     "bf16's precision round away (watch the loss against an fp32 run on long, low-lr runs)")


# A LoRA run's base is frozen: no update to lose, and peft keeps the adapters in fp32 over a bf16 base.
BF16_BASE = "the frozen base held in bf16 (half its memory); the adapters and their AdamW state stay fp32"


def _boundary(candidates: range, fits) -> int | None:
    """The first of ``candidates`` that fits, where fitting is monotone along them (once one fits, all later
    ones do): a bisection, so that the planner answers at once for any size a spec can hold."""
    lo, hi = 0, len(candidates)
    while lo < hi:
        mid = (lo + hi) // 2
        if fits(candidates[mid]):
            hi = mid
        else:
            lo = mid + 1
    return candidates[lo] if lo < len(candidates) else None


def make_plan(job: Resolved) -> FitPlan:
    """Plan a spec resolved against its profile. Pure: reads config.json only."""
    spec, profile, eff = job.spec, job.profile, job.eff
    shape = read_model_shape(spec.model.path)
    params = count_params(shape)
    u = decide_savers(spec, shape, params, _setup(spec, eff, shape, profile), profile)
    if u.grad_accum > 1 and _fits(shape, params, replace(u, defer_grad_sync=True), profile)[0]:
        # One reduce-scatter per step instead of one per micro-batch, where the unsharded gradients fit.
        u = replace(u, defer_grad_sync=True)
    dev = device_memory(shape, params, u, profile)
    host = host_memory(shape, params, u, profile, dev)
    timing = plan_timing(shape, params, u, profile, eff.cpus_per_task, eff.signal_lead_s)
    gen = plan_generator(spec, profile, eff.gpus_per_node, shape, params, u.world, u.shard_degree,
                         training_per_gpu=sum(i.bytes for i in dev.state) + dev.runtime.bytes)
    if gen is not None and gen.round_s is not None:  # the trainers wait for each round and its weight sync
        timing = replace(timing, generation_s=(gen.round_s + gen.sync_s) / spec.grpo.steps_per_generation)
    plan = FitPlan(spec.name, shape, params, u, dev, host, timing, generator=gen)
    # A plan that fits too tightly gets fixes as one that does not fit; each fix leaves that room on a GPU.
    fixes = () if plan.fits and not tight(dev) else tuple(_fixes(shape, params, u, profile, dev.peak, spec.env,
                                                                  spec.train.method, room=HEADROOM))
    refusal = (offload_broadcast_conflict(shape, params, u, spec.env)
               or (quantize_problem(shape, u.shard_degree) if u.quantize and u.lora else None)
               or (gen.refusal if gen else None))
    warnings = [*_warnings(plan, spec, profile, fixes), *([job.size_unknown] if job.size_unknown else [])]
    return replace(plan, fixes=fixes, warnings=tuple(warnings),
                   interval=_interval(job, timing), refusal=refusal, setup_s=setup_work_s(spec, profile))


# Rank 0's send rate over gloo (TCP), assumed (a 10-25 GbE-class path; gloo's broadcast sends the whole tensor
# to each rank in turn), and the longest weight broadcast the plan lets through: a third of the supervisor's
# first set-up bound (900 s), which also holds the model build, the process groups and the first step.
GLOO_BROADCAST_BYTES_PER_S = 1e9
RANK0_BROADCAST_LIMIT_S = 300


def rank0_load_reason(s: ModelShape, u: Setup, env: dict[str, str]) -> str | None:
    """Why the workers will read the weights on rank 0 and broadcast them (jobs/model/build.py), where that is
    known from the spec and config.json; None where each rank reads its own shards (or the folder does not say)."""
    if envvars.get("FSDPJOB_WEIGHT_LOAD", environ=env) == "rank0":
        return "FSDPJOB_WEIGHT_LOAD=rank0"
    if u.lora is not None:
        return "model.lora"
    if s.experts > 1 or s.model_type == "gpt_neox":
        return f"{s.model_type}'s stored names are converted on load"
    return None


def offload_broadcast_conflict(s: ModelShape, p: ParamCount, u: Setup, env: dict[str, str]) -> str | None:
    """fsdp.cpu_offload with the rank-0 weight load: the offloaded shards live on the CPU, so
    set_model_state_dict(broadcast_from_rank0) sends every full tensor over gloo, not NCCL (gpu-review #15)."""
    why = rank0_load_reason(s, u, env)
    if not (u.cpu_offload and u.world > 1 and why):
        return None
    full = p.total * DTYPE_BYTES.get(s.checkpoint_dtype, 4)
    seconds = full * (u.world - 1) / GLOO_BROADCAST_BYTES_PER_S
    if seconds <= RANK0_BROADCAST_LIMIT_S:
        return None
    return (f"fsdp.cpu_offload with rank 0 reading the weights ({why}): the offloaded shards are on the CPU, so every "
            f"full tensor goes over gloo (TCP), {full / 1e9:,.0f} GB to each of {u.world - 1} ranks, "
            f"~{seconds / 60:,.0f} min at an assumed {GLOO_BROADCAST_BYTES_PER_S / 1e9:g} GB/s "
            f"(over {RANK0_BROADCAST_LIMIT_S} s); set fsdp.cpu_offload: false "
            "(`fsdpjob plan --set fsdp.cpu_offload=false` shows the nodes that fit)")


def _interval(job: Resolved, t: Timing) -> IntervalAdvice | None:
    """Young/Daly from the planned save time and the profile's rate of interruptions without warning."""
    rate = job.profile.expected_interruptions_per_day
    if not rate:
        return None
    ckpt = job.spec.checkpoint
    current, how = current_interval(ckpt.interval_steps, ckpt.interval_minutes, t.step_s, job.eff.time_limit_s)
    return advise(t.save_s, 86400.0 / (rate * job.eff.nodes), current, how)


HEADROOM = 0.03  # GPU memory left over below which a plan that fits is flagged


def _warnings(plan: FitPlan, spec: JobSpec, profile: ClusterProfile, fixes: tuple[Fix, ...]) -> list[str]:
    d, h, t = plan.device, plan.host, plan.timing
    out = []
    unit = "GPU" if d.kind == "gpu" else "rank (host RAM / tasks_per_node)"
    if d.budget is None:
        out.append(f"profile {profile.name!r} has no gpu_memory_gb; GPU memory fit not checked")
    elif not d.fits:
        out.append(f"does not fit: peak {d.peak / GiB:.1f} GiB > {d.budget / GiB:.1f} GiB per {unit}")
    elif d.kind == "gpu" and d.budget - d.peak < HEADROOM * d.budget:
        out.append(
            f"GPU headroom {(d.budget - d.peak) / GiB:.1f} GiB ({(d.budget - d.peak) / d.budget:.1%}) is under "
            f"{HEADROOM:.0%} of the usable {d.budget / GiB:.1f} GiB: allocator variance or NCCL buffers beyond the "
            "assumed ones can OOM it"
        )
    if not h.fits:
        out.append(f"host RAM per node: {h.peak / GiB:.0f} GiB needed > {h.budget / GiB:.0f} GiB ({profile.name!r})")
    if not plan.fits and not fixes:
        out.append(
            "no single change makes it fit: combine activation checkpointing, a smaller micro-batch, CPU offload "
            "and more nodes, or use a profile with more memory"
        )
    if plan.setup.attn == "eager" and spec.model.attn_implementation != "eager":
        out.append(f"{plan.model.model_type} has no sdpa attention in transformers: it trains with "
                   f"{plan.setup.attn} attention (counted above); flash_attention_2 is the faster choice on GPUs")
    if plan.setup.dense_mask and d.kind != "cpu":
        out.append(f"packed batches with sdpa attention build a dense {plan.setup.seq_len} x {plan.setup.seq_len} "
                   "mask (counted above) and miss the flash kernel: model.attn_implementation: auto takes varlen "
                   "attention in bf16" + ("" if not plan.model.windowed else " where the model has no sliding window"))
    if spec.fsdp.cpu_offload and d.kind == "cpu":
        out.append("fsdp.cpu_offload has no effect on CPU workers (everything is in host memory already)")
    if plan.model.estimate:
        out.append(plan.model.estimate)
    if plan.trainable.note:
        out.append(plan.trainable.note)
    if plan.model.checkpoint_dtype not in DTYPE_BYTES:
        out.append(f"config.json dtype {plan.model.checkpoint_dtype!r} unknown; load memory assumes 4 bytes/param")
    if plan.setup.cpu_offload:
        out.append("step time leaves out CPU offload's host-side AdamW and PCIe copies: expect it several times longer")
    if t.step_s is None:
        out.append(f"step time is unknown ({t.throughput_note}); the signal lead check covers the save only")
    if t.signal_lead_s < t.needed_lead_s:
        wait = (f"{STEPS_BEFORE_STOP} steps (~{t.step_s:.0f} s each) + {AGREE_EVERY_S:g} s to agree + "
                if t.step_s is not None else "")
        out.append(
            f"preemption signal lead {t.signal_lead_s} s is too short for {wait}one save (~{t.save_s:.0f} s) + margin; "
            f"set preemption.signal_lead_s: {t.needed_lead_s}"
        )
    return out
