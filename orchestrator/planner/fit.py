"""Preflight planner: parameter count from config.json, per-rank and per-node memory, checkpoint and step time.

Pure arithmetic on the login node: reads the model folder's ``config.json`` only (never weights) and imports
neither torch nor transformers. ``make_plan(resolved)`` returns a :class:`Plan`; ``planformat.format_plan``
renders it as a text table and ``Plan.to_json()`` as a dict with stable keys (documented on the method). The
model's shape and parameter count come from ``modelshape.py``.

Units. Memory is in bytes internally and shown in GiB: a profile's ``gpu_memory_gb`` and ``host_ram_gb`` are read
as GiB (an "80GB" A100 has 80 GiB; Slurm's ``G`` is GiB). Checkpoint sizes and storage bandwidth are decimal GB.

What is modelled is the worker (jobs/model.py, jobs/parallelize.py, jobs/train.py): meta init, ``fully_shard`` on
each decoder layer then the root (embedding, final norm, lm_head) with fsdp.reshard_after_forward for both,
``param_dtype`` = compute dtype c (2 bytes bf16, 4 fp32), gradients reduced in fp32, master weights, gradients
and both AdamW moments in model.dtype m; the loss code keeps the logits and upcasts them to fp32. On GPUs the
optimizer is assumed fused (``AdamW(fused=True)``): torch's default foreach AdamW on CUDA adds one more m-byte
copy of the shard during the step (4 B/param/shard in fp32). CPU workers use the per-tensor AdamW.

Per-rank peak = sharded params + AdamW state + the largest of four moments of a (steady-state) step:
  * forward end: saved activations + the loss ((12 + c) bytes x tokens x vocab: logits, fp32 log-softmax and
    its two fp32 gradients) [+ all layers and the root gathered when reshard_after_forward is false];
  * backward, last layer: saved activations + the root gathered again, the lm_head gradient (unsharded until
    the root's reduce-scatter at the very end), the held logits, the layer's gathered params (+ the prefetched
    next layer when sharded over > 1 rank), its unsharded gradients, the previous layer's fp32 reduce-scatter
    input and the layer's gradient working set (3 c x tokens x intermediate, or the eager attention scores);
  * backward end: sharded gradients + the root's unsharded gradients and fp32 reduce-scatter input;
  * optimizer step: sharded gradients (+ 2 temporaries of the largest tensor for the per-tensor AdamW on CPU).
Gradients held across micro-batches (grad_accum_steps > 1) are added to the first two moments. Then a fixed
runtime item (CUDA context + NCCL 1 GiB; a CPU worker process 0.4 GiB) and 5 % for allocator fragmentation.
Saved activations per layer and token, with sdpa / flash attention:
  2 RMSNorms x (4 + 2c) h  (fp32 upcast kept for backward, normalized and output)
  + 3c q_dim + 2c kv_dim   (q, k after RoPE, v for attention; attention output and its contiguous copy for o_proj)
  + 4c intermediate        (gate, silu(gate), up, gate*up for SwiGLU)
eager attention instead keeps q, repeated k/v and output (4c q_dim) plus micro_batch x heads x seq^2 x (4 + c)
(fp32 softmax and its compute-dtype copy). Activation checkpointing keeps each layer's input (c h per token) and
recomputes one layer at a time in backward. On CPU, bf16 matmuls also hold ~12 MiB of oneDNN buffers.
Measured on CPU (bench/plan_accuracy.py, the worker's load_model + train_step): the prediction is 0 to 9 % above
peak RSS over 19 cases, with glibc's mmap threshold frozen (MALLOC_MMAP_THRESHOLD_=131072); stock glibc keeps
freed activations in its heap and runs 15-80 % above live memory on such small models.

The golden seed case (Llama-2-70B, 68.98e9 params, fp32 master weights, bf16 compute, AC, seq 2048, mb 1):
  * 2 nodes x 8 A100-80GB: params + grads + AdamW = 16 B x 68.98e9 / 16 = 69.0e9 B (64.2 GiB); the backward end
    adds the root's 0.52e9 unsharded gradients (2 B) and fp32 reduce-scatter input (4 B) = 3.1e9 B; with the
    CUDA context and 5 % fragmentation the peak is 71.5 GiB < 80 GiB: FITS.
  * 1 node x 8: 16 B x 68.98e9 / 8 = 138e9 B (128.5 GiB) of state alone: does not fit; CPU offload (15 GiB left
    on the GPU, 1.0 TiB of host RAM per node) or a second node fix it.
  * host RAM at load: every rank loading fp32 = 8 x 4 B x 68.98e9 = 2.2e12 B per node, more than a 2 TB node;
    rank-0 loading = one fp16 copy (the checkpoint's dtype) = 0.14e12 B. (Counting each rank's fp32 shard in
    host RAM too gives 0.28e12 B; the worker materializes the shards on the GPUs, so they are not counted there.)
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal

from fsdpjob.orchestrator.core.profiles import ClusterProfile
from fsdpjob.orchestrator.core.spec import JobSpec
from fsdpjob.orchestrator.core.units import GB, GiB, count_text, params_text, size_text, unit_for

from .modelshape import ModelShape, ParamCount, count_params, read_model_shape
from .resolve import Effective, Resolved

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
REDUCE_BYTES = 4  # gradients are reduce-scattered in fp32 whatever the compute dtype

CUDA_RUNTIME_BYTES = 1 * GiB  # CUDA context (~0.5-0.8 GiB) + NCCL communicator buffers
CPU_RUNTIME_BYTES = int(0.4 * GiB)  # python + torch + transformers per worker process (measured: 335 MiB)
CUDA_FRAGMENTATION = 0.05  # caching-allocator blocks freed but not reusable for the next size
CPU_FRAGMENTATION = 0.05  # with glibc's mmap threshold frozen (MALLOC_MMAP_THRESHOLD_=131072); stock glibc keeps more
CPU_BF16_KERNEL_BYTES = 12 * 1024**2  # oneDNN buffers of bf16 matmuls on CPU (measured, independent of model size)
MFU = 0.40  # assumed model FLOPs utilisation on GPUs
# Dense peak FLOP/s per GPU by compute dtype (bf16 tensor cores; fp32 without TF32, torch's default for matmul).
GPU_PEAK_FLOPS = {"a100": {2: 312e12, 4: 19.5e12}, "h100": {2: 989e12, 4: 67e12}, "h200": {2: 989e12, 4: 67e12}}
# Achieved FLOP/s per CPU core on the dev machine (374M Llama, FSDP2 on gloo, one thread per rank).
CPU_FLOPS_PER_CORE = {2: 53e9, 4: 31e9}
SIGNAL_MARGIN_S = 10  # the lead must cover a step + a save + this (or 25 %, whichever is larger)


# ------------------------------------------------------------------------------------------------
# Per-rank memory.


@dataclass(frozen=True)
class Item:
    name: str
    bytes: int
    note: str = ""


@dataclass(frozen=True)
class Moment:
    """One moment of a training step and what is alive then, per rank."""

    name: str
    items: tuple[Item, ...]

    @property
    def bytes(self) -> int:
        return sum(i.bytes for i in self.items)


@dataclass(frozen=True)
class Setup:
    """The knobs of one plan (spec + profile resolved); fixes change these and plan again."""

    nodes: int
    tasks_per_node: int
    replicate_degree: int
    on_gpu: bool
    model_bytes: int  # m: master weights, gradients, AdamW moments
    compute_bytes: int  # c: gathered parameters and activations
    seq_len: int
    micro_batch: int
    grad_accum: int
    activation_checkpointing: bool
    attn: str
    cpu_offload: bool
    reshard: bool  # reshard_after_forward, for the layers and the root

    @property
    def world(self) -> int:
        return self.nodes * self.tasks_per_node

    @property
    def shard_degree(self) -> int:
        return self.world // self.replicate_degree


def _layer_activations(s: ModelShape, u: Setup) -> tuple[int, int]:
    """(bytes one layer keeps for backward, bytes of its gradient working set) for one micro-batch."""
    c, t, b = u.compute_bytes, u.micro_batch * u.seq_len, u.micro_batch
    per_token = 2 * (4 + 2 * c) * s.hidden + 4 * c * s.intermediate
    scores = 0
    if u.attn == "eager":
        per_token += 4 * c * s.q_dim
        scores = b * s.heads * u.seq_len**2 * (4 + (c if c < 4 else 0))
    else:
        per_token += 3 * c * s.q_dim + 2 * c * s.kv_dim
    if s.qk_norm:
        per_token += (4 + c) * (s.q_dim + s.kv_dim)
    working = max(3 * c * t * s.intermediate, b * s.heads * u.seq_len**2 * (4 + 2 * c) if scores else 0)
    return t * per_token + scores, working + 2 * 4 * t * s.hidden


def _moments(s: ModelShape, p: ParamCount, u: Setup) -> tuple[list[Item], list[Moment]]:
    """The sharded state on the device (params, AdamW) and what each of the four moments adds, per rank."""
    m, c, r, w = u.model_bytes, u.compute_bytes, REDUCE_BYTES, u.shard_degree
    t, shard, on_device = u.micro_batch * u.seq_len, math.ceil(p.total / w), not u.cpu_offload
    state = [
        Item("parameters", on_device * shard * m, f"{params_text(p.total)} params x {m} B / {count_text(w, 'shard')}"),
        Item("AdamW state", on_device * 2 * shard * m, f"exp_avg + exp_avg_sq, {m} B each"),
    ]
    grads = Item("gradients", on_device * shard * m, f"sharded, {m} B")
    early_grads = replace(grads, bytes=grads.bytes * (u.grad_accum > 1), note="held across micro-batches")
    root = Item("root gathered", p.root * c, "embedding + final norm + lm_head, compute dtype")
    kept = Item("layers kept gathered", s.layers * p.per_layer * c * (not u.reshard),
                "fsdp.reshard_after_forward: false")
    head = [
        Item("lm_head gradient", s.vocab * s.hidden * c, "unsharded until the root's reduce-scatter"),
        Item("logits", t * s.vocab * c, "held by the loss code through backward"),
    ]
    kernels = Item("bf16 kernel buffers", CPU_BF16_KERNEL_BYTES * (not u.on_gpu and c == 2), "oneDNN (measured)")
    largest = max(s.vocab * s.hidden, s.hidden * s.intermediate, s.hidden * s.q_dim)
    root_grads = Item("root gradients", p.root * (c + r), "unsharded + fp32 reduce-scatter input")
    adamw_temp = Item("AdamW temporaries", 0 if u.on_gpu else 2 * math.ceil(largest / w) * m, "per-tensor AdamW on CPU")
    moments = [
        Moment("forward end (loss)", (early_grads, _saved_activations(s, u), kept,
                                      replace(root, bytes=root.bytes * (not u.reshard)),
                                      Item("loss", (12 + c) * t * s.vocab, "logits + fp32 log-softmax and gradients"),
                                      kernels)),
        Moment("backward, last layer", (early_grads, _saved_activations(s, u), kept, root, *head,
                                        *_layer_transients(s, p, u), kernels)),
        Moment("backward end", (grads, root_grads, kernels)),
        Moment("optimizer step", (grads, adamw_temp, kernels)),
    ]
    return state, moments


def _saved_activations(s: ModelShape, u: Setup) -> Item:
    c, t = u.compute_bytes, u.micro_batch * u.seq_len
    per_layer = t * s.hidden * c if u.activation_checkpointing else _layer_activations(s, u)[0]
    final_norm = (4 + 3 * c) * t * s.hidden
    unit = unit_for(per_layer)
    note = f"{s.layers} layers x {size_text(per_layer, unit)} {unit[0]}"
    note += " (layer inputs, AC)" if u.activation_checkpointing else ""
    return Item("activations", s.layers * per_layer + final_norm, note)


def _layer_transients(s: ModelShape, p: ParamCount, u: Setup) -> list[Item]:
    """The decoder layer in backward: gathered params (+ prefetched next), its gradients and working set."""
    c, layer = u.compute_bytes, p.per_layer
    if u.reshard:
        prefetch = u.shard_degree > 1  # world size 1 copies the shard in place of an all-gather
        gathered = Item("layer gathered", (3 if prefetch else 2) * c * layer,
                        "params + unsharded grads" + (" + prefetched next layer" if prefetch else ""))
    else:
        gathered = Item("layer gradients", c * layer, "unsharded, before the reduce-scatter")
    acts, working = _layer_activations(s, u)
    recompute = acts if u.activation_checkpointing else 0
    return [
        gathered,
        Item("reduce-scatter buffer", REDUCE_BYTES * layer, "previous layer's fp32 reduce-scatter input"),
        Item("layer working set", working + recompute,
             "activation gradients" + (" + recomputed layer" if recompute else "")),
    ]


@dataclass(frozen=True)
class DeviceMemory:
    """Per-rank memory on the training device: a GPU, or the host on CPU profiles (no CUDA context then)."""

    kind: Literal["gpu", "cpu"]
    budget: int | None  # None: the profile does not say
    state: tuple[Item, ...]
    moments: tuple[Moment, ...]
    runtime: Item
    fragmentation: float

    @property
    def peak_moment(self) -> Moment:
        return max(self.moments, key=lambda mo: mo.bytes)

    @property
    def breakdown(self) -> tuple[Item, ...]:
        """What is alive at the peak: state, the peak moment's transients, runtime and fragmentation; sums to peak."""
        live = [i for i in (*self.state, *self.peak_moment.items) if i.bytes]
        frag = Item("fragmentation", int(self.fragmentation * sum(i.bytes for i in live)),
                    f"{self.fragmentation:.0%} of the above")
        return (*live, self.runtime, frag)

    @property
    def peak(self) -> int:
        return sum(i.bytes for i in self.breakdown)

    @property
    def fits(self) -> bool:
        return self.budget is None or self.peak <= self.budget


@dataclass(frozen=True)
class HostMemory:
    """Host RAM per node (rank 0's node at load)."""

    budget: int
    load_rank0: int
    load_every_rank: int
    training: int
    offloaded_per_rank: int  # params + grads + AdamW moved off the GPU by fsdp.cpu_offload

    @property
    def peak(self) -> int:
        return max(self.load_rank0, self.training)

    @property
    def fits(self) -> bool:
        return self.peak <= self.budget


def _device(s: ModelShape, p: ParamCount, u: Setup, profile: ClusterProfile) -> DeviceMemory:
    state, moments = _moments(s, p, u)
    if u.on_gpu:
        budget = int(profile.gpu_memory_gb * GiB) or None
        runtime = Item("CUDA context", CUDA_RUNTIME_BYTES, "context + NCCL buffers")
        return DeviceMemory("gpu", budget, tuple(state), tuple(moments), runtime, CUDA_FRAGMENTATION)
    runtime = Item("process", CPU_RUNTIME_BYTES, "python + torch + transformers")
    budget = int(profile.host_ram_gb * GiB / u.tasks_per_node)
    return DeviceMemory("cpu", budget, tuple(state), tuple(moments), runtime, CPU_FRAGMENTATION)


def _host(s: ModelShape, p: ParamCount, u: Setup, profile: ClusterProfile, dev: DeviceMemory) -> HostMemory:
    """Rank 0 reads the checkpoint in its file dtype and broadcasts it tensor by tensor into the shards, which
    live in host memory only on CPU workers or with CPU offload (on GPUs they are materialized on the device)."""
    shard_bytes = math.ceil(p.total / u.shard_degree) * u.model_bytes
    process = u.tasks_per_node * CPU_RUNTIME_BYTES
    host_shards = u.tasks_per_node * shard_bytes * (not u.on_gpu or u.cpu_offload)
    offloaded = 4 * shard_bytes * u.cpu_offload  # params + grads + 2 AdamW moments
    training = process + u.tasks_per_node * offloaded if u.on_gpu else u.tasks_per_node * dev.peak
    return HostMemory(
        budget=int(profile.host_ram_gb * GiB),
        load_rank0=p.total * DTYPE_BYTES.get(s.checkpoint_dtype, 4) + host_shards + process,
        load_every_rank=u.tasks_per_node * p.total * u.model_bytes + process,
        training=training,
        offloaded_per_rank=offloaded,
    )


# ------------------------------------------------------------------------------------------------
# Time: one step, one checkpoint save, the signal lead.


@dataclass(frozen=True)
class Timing:
    checkpoint_bytes: int
    save_s: float
    flops_per_rank: float  # one optimizer step
    flops_per_s: float | None  # assumed per rank; None: unknown device
    throughput_note: str
    signal_lead_s: int

    @property
    def step_s(self) -> float | None:
        return self.flops_per_rank / self.flops_per_s if self.flops_per_s else None

    @property
    def needed_lead_s(self) -> int:
        """Seconds of warning that cover one step, one save and a margin (rounded up to 10 s)."""
        work = (self.step_s or 0.0) + self.save_s
        return int(math.ceil((work + max(SIGNAL_MARGIN_S, 0.25 * work)) / 10) * 10)


def _throughput(u: Setup, profile: ClusterProfile, cpus_per_task: int | None) -> tuple[float | None, str]:
    c = u.compute_bytes
    dtype = "bf16" if c == 2 else "fp32"
    if not u.on_gpu:
        cores = cpus_per_task or 1
        rate = CPU_FLOPS_PER_CORE[c] * cores
        basis = f"{count_text(cores, 'core')} x {CPU_FLOPS_PER_CORE[c] / 1e9:.0f}, {dtype}, measured on CPU"
        return rate, f"{rate / 1e9:.0f} GFLOP/s per rank ({basis})"
    gpu = (profile.gpu_type or "").lower()
    for key, peaks in GPU_PEAK_FLOPS.items():
        if key in gpu:
            return peaks[c] * MFU, f"{MFU:.0%} MFU of {peaks[c] / 1e12:.0f} TFLOP/s {dtype} ({profile.gpu_type})"
    return None, f"unknown for gpu_type {profile.gpu_type!r}"


def _timing(s: ModelShape, p: ParamCount, u: Setup, profile: ClusterProfile, cpus: int | None, lead: int) -> Timing:
    matmul_params = p.total - (0 if s.tied else p.embedding)  # the embedding lookup does no matmul
    per_token = 6 * matmul_params + 6 * s.layers * u.seq_len * s.q_dim  # causal attention: half of 12 L s d
    if u.activation_checkpointing:
        per_token *= 4 / 3  # forward runs twice
    tokens = u.micro_batch * u.grad_accum * u.seq_len
    rate, note = _throughput(u, profile, cpus)
    ckpt = p.total * u.model_bytes * 3  # params + exp_avg + exp_avg_sq
    save = ckpt / (profile.storage_bandwidth_gbps * GB * u.nodes)
    return Timing(ckpt, save, per_token * tokens, rate, note, lead)


# ------------------------------------------------------------------------------------------------
# The plan and the fixes.


@dataclass(frozen=True)
class Fix:
    change: str  # spec overrides, as `--set` takes them
    peak: int  # per-rank device peak after the change
    saves: int  # device bytes saved per rank (negative: more)
    why: str


@dataclass(frozen=True)
class Plan:
    name: str
    model: ModelShape
    params: ParamCount
    setup: Setup
    device: DeviceMemory
    host: HostMemory
    timing: Timing
    fixes: tuple[Fix, ...] = ()
    warnings: tuple[str, ...] = field(default_factory=tuple)

    @property
    def fits(self) -> bool:
        return self.device.fits and self.host.fits

    def to_json(self) -> dict[str, Any]:
        """Stable keys; sizes in bytes, times in seconds, null where unknown.

        - fits: bool
        - model: model_type, vocab, hidden, intermediate, layers, heads, kv_heads, head_dim, tied, qkv_bias, o_bias,
          mlp_bias, qk_norm, checkpoint_dtype
        - params: total, embedding, per_layer, attention_per_layer, mlp_per_layer, norms_per_layer, layers,
          final_norm, lm_head
        - topology: nodes, tasks_per_node, world_size, shard_degree, replicate_degree, device ("gpu" | "cpu")
        - device_memory (per rank): kind, budget_bytes, peak_bytes, peak_moment, fits,
          breakdown [{name, bytes, note}] (sums to peak_bytes), moments {name: bytes on top of the state}
        - host_memory (per node): budget_bytes, load_rank0_bytes, load_every_rank_bytes, training_bytes,
          offloaded_per_rank_bytes, fits
        - checkpoint: bytes, save_s; step: seconds, flops_per_rank, flops_per_s_per_rank, assumption
        - signal: lead_s, needed_s
        - fixes [{change, peak_bytes, saves_bytes, why}], cheapest first; warnings [str]
        """
        p, d, h, t, u = self.params, self.device, self.host, self.timing, self.setup
        return {
            "fits": self.fits,
            "model": asdict(self.model),
            "params": {
                "total": p.total, "embedding": p.embedding, "per_layer": p.per_layer,
                "attention_per_layer": p.attention, "mlp_per_layer": p.mlp, "norms_per_layer": p.norms,
                "layers": p.layers, "final_norm": p.final_norm, "lm_head": p.lm_head,
            },
            "topology": {
                "nodes": u.nodes, "tasks_per_node": u.tasks_per_node, "world_size": u.world,
                "shard_degree": u.shard_degree, "replicate_degree": u.replicate_degree, "device": d.kind,
            },
            "device_memory": {
                "kind": d.kind, "budget_bytes": d.budget, "peak_bytes": d.peak, "peak_moment": d.peak_moment.name,
                "fits": d.fits, "breakdown": [asdict(i) for i in d.breakdown],
                "moments": {mo.name: mo.bytes for mo in d.moments},
            },
            "host_memory": {
                "budget_bytes": h.budget, "load_rank0_bytes": h.load_rank0, "load_every_rank_bytes": h.load_every_rank,
                "training_bytes": h.training, "offloaded_per_rank_bytes": h.offloaded_per_rank, "fits": h.fits,
            },
            "checkpoint": {"bytes": t.checkpoint_bytes, "save_s": t.save_s},
            "step": {"seconds": t.step_s, "flops_per_rank": t.flops_per_rank, "flops_per_s_per_rank": t.flops_per_s,
                     "assumption": t.throughput_note},
            "signal": {"lead_s": t.signal_lead_s, "needed_s": t.needed_lead_s},
            "fixes": [
                {"change": f.change, "peak_bytes": f.peak, "saves_bytes": f.saves, "why": f.why} for f in self.fixes
            ],
            "warnings": list(self.warnings),
        }


def _setup(spec: JobSpec, eff: Effective) -> Setup:
    on_gpu = eff.gpus_per_node > 0
    return Setup(
        nodes=eff.nodes,
        tasks_per_node=eff.tasks_per_node,
        replicate_degree=spec.fsdp.replicate_degree,
        on_gpu=on_gpu,
        model_bytes=DTYPE_BYTES[spec.model.dtype],
        compute_bytes=2 if spec.fsdp.mixed_precision == "bf16" else 4,
        seq_len=spec.data.seq_len,
        micro_batch=spec.train.micro_batch_size,
        grad_accum=spec.train.grad_accum_steps,
        activation_checkpointing=spec.model.activation_checkpointing,
        attn=spec.model.attn_implementation,
        cpu_offload=spec.fsdp.cpu_offload and on_gpu,  # on CPU workers everything already lives on the host
        reshard=spec.fsdp.reshard_after_forward,
    )


def _fits(s: ModelShape, p: ParamCount, u: Setup, profile: ClusterProfile) -> tuple[bool, int]:
    dev = _device(s, p, u, profile)
    return dev.fits and _host(s, p, u, profile, dev).fits, dev.peak


def _fixes(s: ModelShape, p: ParamCount, u: Setup, profile: ClusterProfile, peak: int) -> list[Fix]:
    """Single changes that make the plan fit, cheapest first; each one has been planned and fits."""
    out: list[Fix] = []

    def consider(change: str, new: Setup, why: str) -> bool:
        ok, new_peak = _fits(s, p, new, profile)
        if ok:
            out.append(Fix(change, new_peak, peak - new_peak, why))
        return ok

    ac = replace(u, activation_checkpointing=True)
    if not u.activation_checkpointing:
        consider("model.activation_checkpointing=true", ac, "recompute layers in backward: ~30% more compute")
    # A smaller micro-batch alone, else together with AC (only when neither alone was enough).
    for base, prefix in ((u, ""), (ac, "model.activation_checkpointing=true ")):
        if base is ac and (u.activation_checkpointing or out):
            break
        for mb in range(u.micro_batch - 1, 0, -1):
            accum = math.ceil(u.micro_batch * u.grad_accum / mb)
            change = f"{prefix}train.micro_batch_size={mb} train.grad_accum_steps={accum}"
            if consider(change, replace(base, micro_batch=mb, grad_accum=accum), "same global batch, more micro-steps"):
                break
    if u.on_gpu and not u.cpu_offload:
        consider("fsdp.cpu_offload=true", replace(u, cpu_offload=True), "state on the host: steps much slower")
    if profile.max_nodes is None or profile.max_nodes > u.nodes:
        most = profile.max_nodes or max(4 * u.nodes, u.nodes + 64)
        for nodes in range(u.nodes + 1, most + 1):
            more = replace(u, nodes=nodes)
            if more.world % u.replicate_degree == 0 and consider(
                f"resources.nodes={nodes}", more, f"shard over {more.shard_degree} ranks: the fewest nodes that fit"
            ):
                break
    return out


def make_plan(job: Resolved) -> Plan:
    """Plan a spec resolved against its profile. Pure: reads config.json only."""
    spec, profile, eff = job.spec, job.profile, job.eff
    shape = read_model_shape(spec.model.path)
    params = count_params(shape)
    u = _setup(spec, eff)
    dev = _device(shape, params, u, profile)
    host = _host(shape, params, u, profile, dev)
    timing = _timing(shape, params, u, profile, eff.cpus_per_task, eff.signal_lead_s)
    plan = Plan(spec.name, shape, params, u, dev, host, timing)
    fixes = () if plan.fits else tuple(_fixes(shape, params, u, profile, dev.peak))
    return replace(plan, fixes=fixes, warnings=tuple(_warnings(plan, spec, profile, fixes)))


def _warnings(plan: Plan, spec: JobSpec, profile: ClusterProfile, fixes: tuple[Fix, ...]) -> list[str]:
    d, h, t = plan.device, plan.host, plan.timing
    out = []
    unit = "GPU" if d.kind == "gpu" else "rank (host RAM / tasks_per_node)"
    if d.budget is None:
        out.append(f"profile {profile.name!r} has no gpu_memory_gb; GPU memory fit not checked")
    elif not d.fits:
        out.append(f"does not fit: peak {d.peak / GiB:.1f} GiB > {d.budget / GiB:.1f} GiB per {unit}")
    if not h.fits:
        out.append(f"host RAM per node: {h.peak / GiB:.0f} GiB needed > {h.budget / GiB:.0f} GiB ({profile.name!r})")
    if not plan.fits and not fixes:
        out.append(
            "no single change makes it fit: combine activation checkpointing, a smaller micro-batch, CPU offload "
            "and more nodes, or use a profile with more memory"
        )
    if spec.fsdp.cpu_offload and d.kind == "cpu":
        out.append("fsdp.cpu_offload has no effect on CPU workers (everything is in host memory already)")
    if plan.model.checkpoint_dtype not in DTYPE_BYTES:
        out.append(f"config.json dtype {plan.model.checkpoint_dtype!r} unknown; load memory assumes 4 bytes/param")
    if plan.setup.cpu_offload:
        out.append("step time leaves out CPU offload's host-side AdamW and PCIe copies: expect it several times longer")
    if t.step_s is None:
        out.append(f"step time is unknown ({t.throughput_note}); the signal lead check covers the save only")
    if t.signal_lead_s < t.needed_lead_s:
        step = f"one step (~{t.step_s:.0f} s) + " if t.step_s is not None else ""
        out.append(
            f"preemption signal lead {t.signal_lead_s} s is too short for {step}one save (~{t.save_s:.0f} s) + margin; "
            f"set preemption.signal_lead_s: {t.needed_lead_s}"
        )
    return out
