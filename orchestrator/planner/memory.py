"""The planner's memory model: per-rank device memory at the peak of a training step, and host RAM per node.

Units. Memory is in bytes internally and shown in GiB: a profile's ``gpu_memory_gb`` and ``host_ram_gb`` are read
as GiB (an "80GB" A100 has 80 GiB; Slurm's ``G`` is GiB).

What is modelled is the worker (jobs/model/build.py, jobs/model/parallelize.py, jobs/train.py): meta init,
``fully_shard`` on each decoder layer with fsdp.reshard_after_forward, then the root (embedding, final norm,
lm_head), which stays gathered from the forward into the backward (it is the first unit the backward needs),
``param_dtype`` = compute dtype c (2 bytes bf16, 4 fp32), gradients reduced in fp32, master weights, gradients
and both AdamW moments in model.dtype m; the loss code keeps the logits and upcasts them to fp32. The
optimizer is fused (``AdamW(fused=True)``, on GPUs and CPUs alike): it updates in place and holds no temporaries
(torch's default foreach AdamW on CUDA would add one more m-byte copy of the shard during the step).

Per-rank peak = sharded params + AdamW state + the largest of five moments of a (steady-state) step:
  * forward end: saved activations + the loss ((12 + c) bytes x tokens x vocab: logits, fp32 log-softmax and
    its two fp32 gradients) + the root gathered [+ all layers when reshard_after_forward is false];
  * backward, last layer: saved activations + the root gathered again, the lm_head gradient (unsharded until
    the root's reduce-scatter at the very end), the held logits, the layer's gathered params (+ the prefetched
    next layer when sharded over > 1 rank), its unsharded gradients, the previous layer's fp32 reduce-scatter
    input and the layer's gradient working set (3 c x tokens x intermediate, or the eager attention scores);
  * backward, first layer: every layer's sharded gradients (the others are reduce-scattered by then) + the root
    gathered, the lm_head gradient, the held logits, the first layer's saved activations and its transients;
  * backward end: sharded gradients + the root's unsharded gradients and fp32 reduce-scatter input;
  * optimizer step: sharded gradients.
Gradients held across micro-batches (grad_accum_steps > 1) are added to the first two moments. Then a runtime
item and allocator slack: 5 % for CUDA's caching allocator, 30 % for glibc's (it keeps freed blocks in its heap for
reuse). The CUDA runtime item is an assumption, printed as one with the plan (cuda_runtime): the CUDA context, the
cuBLAS/cuBLASLt workspaces and NCCL's buffers per communicator the worker opens (the default group, which a 1-D mesh
reuses; HSDP adds its two dimension groups; the gloo groups hold no GPU memory). Not measured yet: bench/gpu
reports device-used minus reserved (what the item stands for) to check it. A CPU worker's process is 0.4 GiB.
The GPU budget is what torch can allocate (usable_gpu_memory), not the card's nominal size: the driver and ECC
keep ~1 % (an 80 GB A100/H100 shows ~79.1 GiB, a 141 GB H200 ~139.5 GiB).
Saved activations per layer and token, with sdpa / flash attention:
  2 RMSNorms x (4 + 2c) h  (fp32 upcast kept for backward, normalized and output)
  + 3c q_dim + 2c kv_dim   (q, k after RoPE, v for attention; attention output and its contiguous copy for o_proj)
  + 4c intermediate        (gate, silu(gate), up, gate*up for SwiGLU)
eager attention instead keeps q, repeated k/v and output (4c q_dim) plus micro_batch x heads x seq^2 x (4 + c)
(fp32 softmax and its compute-dtype copy). Activation checkpointing keeps each layer's input (c h per token) and
recomputes one layer at a time in backward. On CPU, bf16 matmuls also hold ~12 MiB of oneDNN buffers.
With LoRA (model.lora; lora.py counts the adapters) the frozen base is held as sharded weights only: gradients,
AdamW state, the reduce-scatter input and the checkpoint are those of the adapters (and modules_to_save), the
gathered layers and root also hold the adapters, the lm_head gradient exists only when lm_head trains, and each
adapted layer keeps r values per token (plus its dropped input with dropout).
Host RAM per node while training on GPUs: each worker process (CUDA libraries, CUDA_PROCESS_BYTES), the
offloaded state with fsdp.cpu_offload, and with checkpoint.async_save the stager's pinned copy of the rank's
params + both AdamW moments, which it keeps between saves.
Measured on CPU (bench/plan_accuracy.py, the worker's load_model + train_step, glibc's default allocator as the
shipped profiles run it): the three quick cases land at +9 %, +1 % and -5 % of peak RSS.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
from typing import Any, Literal

from fsdpjob.orchestrator.core.jobspec.profiles import ClusterProfile
from fsdpjob.orchestrator.core.units import GiB, count_text, params_text, size_text, unit_for

from .lora import adapter_activations, trainable
from .modelshape import ModelShape, ParamCount

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
REDUCE_BYTES = 4  # gradients are reduce-scattered in fp32 whatever the compute dtype

# The CUDA runtime item's parts (assumed; bench/gpu's device-used minus reserved checks their sum):
CUDA_CONTEXT_BYTES = int(0.5 * GiB)  # the context and the kernel images CUDA loads lazily
CUBLAS_WORKSPACE_BYTES = int(0.125 * GiB)  # cuBLAS + cuBLASLt workspaces (per handle and stream)
NCCL_COMMUNICATOR_BYTES = int(0.5 * GiB)  # one NCCL communicator's channel buffers (NVLS on NVSwitch can take more)
CPU_RUNTIME_BYTES = int(0.4 * GiB)  # python + torch + transformers per worker process (measured: 335 MiB)
# A CUDA torch worker's own RSS: the CUDA runtime, cuBLAS/cuDNN and NCCL libraries and their host buffers. Not
# measured here (no GPU lent yet): 1.5-3 GiB is the range CUDA torch processes show; the high end is planned.
CUDA_PROCESS_BYTES = 3 * GiB
CUDA_FRAGMENTATION = 0.05  # caching-allocator blocks freed but not reusable for the next size
# glibc's default allocator keeps freed blocks (activations, gathered layers) in its heap for reuse: peak RSS
# runs 19-37 % above what the frozen-threshold measurement saw (bench/plan_accuracy.py --frozen). Modelled as
# slack on the live bytes rather than trading ~25 % of the step time for a tidy RSS (MALLOC_MMAP_THRESHOLD_).
CPU_FRAGMENTATION = 0.30
# oneDNN's buffers for bf16 matmuls on a CPU it runs them on (core/hostcpu.py; measured, whatever the model size)
CPU_BF16_KERNEL_BYTES = 12 * 1024**2


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
    reshard: bool  # reshard_after_forward, for the layers (the root stays gathered after forward either way)
    # With grad_accum > 1: micro-batches before the last skip the reduce-scatter and accumulate unsharded
    # fp32 gradients instead (less communication, more memory); make_plan turns it on where it fits.
    defer_grad_sync: bool = False
    lora: Any = None  # the spec's model.lora: only the adapters train (lora.py counts them); None: every weight
    async_save: bool = False  # checkpoint.async_save: DCP's stager keeps a host copy of the saved state
    memory_tier: bool = False  # checkpoint.memory_interval_steps: snapshots in node-local shared memory
    packed: bool = False  # boundary-aware packing: with sdpa, transformers builds a dense block-diagonal mask
    onednn_bf16: bool = False  # CPU workers whose CPU runs bf16 matmuls in oneDNN (core/hostcpu.py)
    rows_per_example: int = 1  # preference pairs: both answers go through the forward, one row each
    reference_copy: bool = False  # dpo/kto reference: live on a full fine-tune: a frozen sharded copy of the model

    @property
    def rows(self) -> int:
        """Rows of one micro-batch's forward."""
        return self.micro_batch * self.rows_per_example

    @property
    def dense_mask(self) -> bool:
        """sdpa on packed rows on GPUs: a [B, 1, S, S] bool mask per forward, which SDPA's memory-efficient kernel
        turns into a bias in the compute dtype per layer and keeps for backward (no flash kernel takes a mask);
        varlen attention needs none. On CPU the measured peaks show no such bias kept (tests/worker/
        test_plan_accuracy.py's S case on an AVX-512 CPU: 69-71 MiB against 73 planned without the term, 78 with
        it)."""
        return self.packed and self.attn == "sdpa" and self.on_gpu

    @property
    def world(self) -> int:
        return self.nodes * self.tasks_per_node

    @property
    def shard_degree(self) -> int:
        return self.world // self.replicate_degree


def _layer_activations(s: ModelShape, u: Setup) -> tuple[int, int]:
    """(bytes one layer keeps for backward, bytes of its gradient working set) for one micro-batch."""
    c, t, b = u.compute_bytes, u.rows * u.seq_len, u.rows
    per_token = 2 * (4 + 2 * c) * s.hidden + 4 * c * s.intermediate
    scores = 0
    if u.attn == "eager":
        per_token += 4 * c * s.q_dim
        scores = b * s.heads * u.seq_len**2 * (4 + (c if c < 4 else 0))
    else:
        per_token += 3 * c * s.q_dim + 2 * c * s.kv_dim
        if u.dense_mask:
            scores = b * u.seq_len**2 * c  # the layer's bias from the packed mask, saved for backward
    if s.qk_norm:
        per_token += (4 + c) * (s.q_dim + s.kv_dim)
    per_token += adapter_activations(s, u.lora, c)
    working = max(3 * c * t * s.intermediate, b * s.heads * u.seq_len**2 * (4 + 2 * c) if u.attn == "eager" else 0)
    mask = b * u.seq_len**2 if u.dense_mask else 0  # the bool mask itself, shared by the layers
    return t * per_token + scores, working + 2 * 4 * t * s.hidden + mask


def _moments(s: ModelShape, p: ParamCount, u: Setup) -> tuple[list[Item], list[Moment]]:
    """The sharded state on the device (params, AdamW) and what each of the four moments adds, per rank."""
    m, c, r, w = u.model_bytes, u.compute_bytes, REDUCE_BYTES, u.shard_degree
    tr = trainable(s, p, u.lora)
    t, shard, on_device = u.rows * u.seq_len, math.ceil(tr.weights / w), not u.cpu_offload
    trained_shard = math.ceil(tr.trained / w)
    frozen = f", {params_text(tr.trained)} of them train (LoRA)" if tr.is_lora else ""
    state = [
        Item("parameters", on_device * shard * m,
             f"{params_text(tr.weights)} params x {m} B / {count_text(w, 'shard')}{frozen}"),
        Item("AdamW state", on_device * 2 * trained_shard * m, f"exp_avg + exp_avg_sq, {m} B each"),
        Item("reference model (live)", on_device * shard * m * u.reference_copy,
             "a frozen sharded copy of the starting weights; reference: cached holds none"),
    ]
    grads = Item("gradients", on_device * trained_shard * m, f"sharded, {m} B")
    early_grads = replace(grads, bytes=grads.bytes * (u.grad_accum > 1), note="held across micro-batches")
    if u.grad_accum > 1 and u.defer_grad_sync:
        early_grads = Item("accumulated gradients", tr.trained * REDUCE_BYTES,
                           "unsharded fp32, held across micro-batches (reduce-scatter on the last only)")
    root = Item("root gathered", tr.root_weights * c, "embedding + final norm + lm_head, compute dtype")
    # The first layer's own shard of gradients comes only from its reduce-scatter, after its backward.
    other_grads = replace(grads, bytes=on_device * (trained_shard - math.ceil(tr.layer_trained / w)) * m,
                          note=f"sharded, {m} B, every layer's but the first")
    kept = Item("layers kept gathered", s.layers * tr.layer_weights * c * (not u.reshard),
                "fsdp.reshard_after_forward: false")
    head = [
        Item("lm_head gradient", s.vocab * s.hidden * c * tr.head_trained,
             "unsharded until the root's reduce-scatter"),
        Item("logits", t * s.vocab * c, "held by the loss code through backward"),
    ]
    kernels = Item("bf16 kernel buffers", CPU_BF16_KERNEL_BYTES * (not u.on_gpu and c == 2 and u.onednn_bf16),
                   "oneDNN (measured)")
    root_grads = Item("root gradients", tr.root_trained * (c + r), "unsharded + fp32 reduce-scatter input")
    moments = [
        Moment("forward end (loss)", (early_grads, _saved_activations(s, u), kept,
                                      root,
                                      Item("loss", (12 + c) * t * s.vocab, "logits + fp32 log-softmax and gradients"),
                                      kernels)),
        Moment("backward, last layer", (early_grads, _saved_activations(s, u), kept, root, *head,
                                        *_layer_transients(s, p, u), kernels)),
        # With one micro-batch the first layer's backward runs with every other layer's gradients already
        # reduce-scattered: all sharded gradients, the root and its head gradient, the first layer's saved
        # activations and its transients are alive together.
        Moment("backward, first layer", (other_grads, _one_layer_activations(s, u), root, *head,
                                         *_layer_transients(s, p, u), kernels)),
        Moment("backward end", (grads, root_grads, kernels)),
        Moment("optimizer step", (grads, kernels)),
    ]
    return state, moments


def _kept_per_layer(s: ModelShape, u: Setup) -> int:
    """Bytes one layer keeps for its backward: its input with activation checkpointing, else its activations."""
    return u.rows * u.seq_len * s.hidden * u.compute_bytes if u.activation_checkpointing \
        else _layer_activations(s, u)[0]


def _one_layer_activations(s: ModelShape, u: Setup) -> Item:
    per_layer = _kept_per_layer(s, u)
    return Item("first layer's activations", per_layer, "saved for its backward" + (" (input, AC)" if
                                                                                   u.activation_checkpointing else ""))


def _saved_activations(s: ModelShape, u: Setup) -> Item:
    c, t = u.compute_bytes, u.rows * u.seq_len
    per_layer = _kept_per_layer(s, u)
    final_norm = (4 + 3 * c) * t * s.hidden
    unit = unit_for(per_layer)
    note = f"{s.layers} layers x {size_text(per_layer, unit)} {unit[0]}"
    note += " (layer inputs, AC)" if u.activation_checkpointing else ""
    return Item("activations", s.layers * per_layer + final_norm, note)


def _layer_transients(s: ModelShape, p: ParamCount, u: Setup) -> list[Item]:
    """The decoder layer in backward: gathered params (+ prefetched next), its gradients and working set."""
    tr = trainable(s, p, u.lora)
    c, layer, layer_grads = u.compute_bytes, tr.layer_weights, tr.layer_trained
    if u.reshard:
        prefetch = u.shard_degree > 1  # world size 1 copies the shard in place of an all-gather
        gathered = Item("layer gathered", (2 if prefetch else 1) * c * layer + c * layer_grads,
                        "params + unsharded grads" + (" + prefetched next layer" if prefetch else ""))
    else:
        gathered = Item("layer gradients", c * layer_grads, "unsharded, before the reduce-scatter")
    acts, working = _layer_activations(s, u)
    recompute = acts if u.activation_checkpointing else 0
    return [
        gathered,
        Item("reduce-scatter buffer", REDUCE_BYTES * layer_grads, "previous layer's fp32 reduce-scatter input"),
        Item("layer working set", working + recompute,
             "activation gradients" + (" + recomputed layer" if recompute else "")),
    ]


# What torch can allocate per GPU (torch.cuda.get_device_properties().total_memory), in GiB: nvidia-smi's total
# less the driver's reserve. The first pattern found in the profile's gpu_type (lower case) whose figure is within
# 5 % under its gpu_memory_gb wins (so an "A100" of 80 GiB is not planned as the 40 GiB one).
USABLE_GIB = ((r"h200", 139.5), (r"h100", 79.1), (r"a100", 79.1), (r"a100", 39.4))
USABLE_FRACTION = 0.989  # another type: nominal less the reserve the known cards show (79.1 / 80, 139.5 / 141)


def usable_gpu_memory(profile: ClusterProfile) -> tuple[int, str]:
    """(bytes torch can allocate per GPU, where that figure comes from); 0 when the profile gives no GPU memory."""
    if profile.gpu_usable_memory_gb:
        return int(profile.gpu_usable_memory_gb * GiB), "the profile's gpu_usable_memory_gb"
    nominal = profile.gpu_memory_gb
    if not nominal:
        return 0, ""
    for pattern, gib in USABLE_GIB:
        if re.search(pattern, (profile.gpu_type or "").lower()) and 0.95 * nominal <= gib <= nominal:
            return int(gib * GiB), f"what torch sees of a {nominal:g} GiB {profile.gpu_type}"
    return (int(nominal * USABLE_FRACTION * GiB),
            f"{nominal:g} GiB less {1 - USABLE_FRACTION:.1%}, assumed: set the profile's gpu_usable_memory_gb")


def nccl_communicators(u: Setup) -> int:
    """NCCL communicators a GPU rank opens: the default group (a 1-D mesh reuses it), + HSDP's two mesh groups."""
    return 1 + 2 * (u.replicate_degree > 1)


def cuda_runtime(u: Setup) -> Item:
    """The device memory outside torch's allocator pools (or beside them), an estimate the plan prints as one."""
    n = nccl_communicators(u)
    total = CUDA_CONTEXT_BYTES + CUBLAS_WORKSPACE_BYTES + n * NCCL_COMMUNICATOR_BYTES
    return Item("CUDA runtime (assumed)", total,
                f"context {CUDA_CONTEXT_BYTES / GiB:.2f} + cuBLAS {CUBLAS_WORKSPACE_BYTES / GiB:.2f} + NCCL "
                f"{NCCL_COMMUNICATOR_BYTES / GiB:.2f} x {count_text(n, 'communicator')} GiB")


@dataclass(frozen=True)
class DeviceMemory:
    """Per-rank memory on the training device: a GPU, or the host on CPU profiles (no CUDA context then)."""

    kind: Literal["gpu", "cpu"]
    budget: int | None  # None: the profile does not say
    state: tuple[Item, ...]
    moments: tuple[Moment, ...]
    runtime: Item
    fragmentation: float
    budget_note: str = ""  # where a GPU budget comes from (usable, not nominal)

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
    own_shards: bool = False  # each rank reads only its own shards (load_rank0 then holds no full copy)
    staged_per_rank: int = 0  # checkpoint.async_save: the stager's pinned copy of params + both AdamW moments
    process_per_rank: int = CPU_RUNTIME_BYTES  # the worker process itself (CUDA libraries on GPUs)
    memory_tier: int = 0  # the memory checkpoint tier on the node: memory_tier_bytes()

    @property
    def peak(self) -> int:
        return max(self.load_rank0, self.training)

    @property
    def fits(self) -> bool:
        return self.peak <= self.budget


def device_memory(s: ModelShape, p: ParamCount, u: Setup, profile: ClusterProfile) -> DeviceMemory:
    state, moments = _moments(s, p, u)
    if u.on_gpu:
        usable, where = usable_gpu_memory(profile)
        return DeviceMemory("gpu", usable or None, tuple(state), tuple(moments), cuda_runtime(u), CUDA_FRAGMENTATION,
                            where)
    runtime = Item("process", CPU_RUNTIME_BYTES, "python + torch + transformers")
    budget = int(profile.host_ram_gb * GiB / u.tasks_per_node)
    return DeviceMemory("cpu", budget, tuple(state), tuple(moments), runtime, CPU_FRAGMENTATION)


def host_memory(s: ModelShape, p: ParamCount, u: Setup, profile: ClusterProfile, dev: DeviceMemory) -> HostMemory:
    """At load, each rank reads its own shards of safetensors weights (else rank 0 reads the checkpoint in its file
    dtype and broadcasts it tensor by tensor: _load_read_bytes); the shards live in host memory only on CPU workers
    or with CPU offload (on GPUs they are materialized on the device)."""
    tr = trainable(s, p, u.lora)
    shard_bytes = math.ceil(tr.weights / u.shard_degree) * u.model_bytes
    process_per_rank = CUDA_PROCESS_BYTES if u.on_gpu else CPU_RUNTIME_BYTES
    process = u.tasks_per_node * process_per_rank
    host_shards = u.tasks_per_node * shard_bytes * (not u.on_gpu or u.cpu_offload)
    trained_bytes = math.ceil(tr.trained / u.shard_degree) * u.model_bytes
    # params + grads + 2 AdamW moments (of what trains)
    offloaded = (shard_bytes + 3 * trained_bytes) * u.cpu_offload
    # DefaultStager keeps its (pinned) buffers between saves: the saved tensors, params + exp_avg + exp_avg_sq. On
    # CPU workers the device model (dev.peak, which is host RAM) does not hold it either, but the CPU plan is
    # left as measured (bench/plan_accuracy.py) until a staged CPU run is measured too.
    staged = (shard_bytes + 2 * trained_bytes) * (u.async_save and u.on_gpu)
    training = process + u.tasks_per_node * (offloaded + staged) if u.on_gpu else u.tasks_per_node * dev.peak
    tier = memory_tier_bytes(s, p, u)
    training += tier
    return HostMemory(
        budget=int(profile.host_ram_gb * GiB),
        load_rank0=_load_read_bytes(s, p, u) + host_shards + process,
        load_every_rank=u.tasks_per_node * p.total * u.model_bytes + process,
        training=training,
        offloaded_per_rank=offloaded,
        own_shards=reads_own_shards(s, u),
        staged_per_rank=staged,
        process_per_rank=process_per_rank,
        memory_tier=tier,
    )


def memory_tier_bytes(s: ModelShape, p: ParamCount, u: Setup) -> int:
    """Host RAM per node the memory tier holds (jobs/checkpoint/memory.py): each rank's saved state (params + both
    AdamW moments of what trains) in shared memory, as much again for the replica it keeps of a rank of another
    node (none on one node), and its stager's copy of the same, kept in the process between snapshots. Counted at
    the peak, while a new snapshot is written beside the newest committed one: twice the files."""
    if not u.memory_tier:
        return 0
    tr = trainable(s, p, u.lora)
    saved = (math.ceil(tr.weights / u.shard_degree) * u.model_bytes
             + 2 * math.ceil(tr.trained / u.shard_degree) * u.model_bytes)
    copies = 2 if u.nodes > 1 else 1  # own + replica
    return u.tasks_per_node * saved * (2 * copies + 1)


def reads_own_shards(s: ModelShape, u: Setup) -> bool:
    """Whether the workers read the weights each rank its own shards (jobs/model/weightload.py): safetensors
    weights, except where transformers converts the stored names on load (MoE experts, gpt_neox's embed_out) and
    LoRA, which rank 0 reads whole and broadcasts."""
    return s.safetensors and u.lora is None and s.experts == 1 and s.model_type != "gpt_neox"


def _load_read_bytes(s: ModelShape, p: ParamCount, u: Setup) -> int:
    """Host bytes per node the weight read holds on top of the shards: one full copy in the file's dtype on rank 0,
    or, reading own shards, each rank's buffer for one shard of the largest tensor (cast or moved to the GPU)."""
    stored = DTYPE_BYTES.get(s.checkpoint_dtype, 4)
    if not reads_own_shards(s, u):
        return p.total * stored
    largest = max(s.vocab * s.hidden, s.hidden * s.intermediate, s.hidden * s.q_dim)
    return u.tasks_per_node * math.ceil(largest / u.shard_degree) * stored
