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
item and allocator slack: 5 or 12 % for CUDA's caching allocator (below), 30 % for glibc's (it keeps freed blocks
in its heap for reuse). The CUDA runtime item is an assumption, printed as one with the plan (cuda_runtime): the
CUDA context, the cuBLAS/cuBLASLt workspaces and NCCL's buffers per communicator the worker opens (the default
group, which a 1-D mesh reuses; HSDP adds its two dimension groups; the gloo groups hold no GPU memory). Not
measured yet: bench/gpu reports device-used minus reserved (what the item stands for) to check it. A CPU worker's
process is 0.4 GiB. The GPU budget is what torch can allocate (usable_gpu_memory), not the card's nominal size:
the driver and ECC keep ~1 % (an 80 GB A100/H100 shows ~79.1 GiB, a 141 GB H200 ~139.5 GiB).
Saved activations per layer (eager or compiled blocks, no, full or selective activation checkpointing): see
activations.py; the moments and the root's items with fsdp.separate_root and train.loss: chunked: moments.py. On
CPU, bf16 matmuls also hold ~10 MiB of oneDNN buffers, kept from the first matmul on (no slack on them).
The savers (issue 41) change these terms: train.optimizer_state_dtype the AdamW state (and its offloaded, staged
and checkpointed copies), fsdp.reduce_dtype the reduce-scatter inputs and the deferred-sync accumulators, and the
allocator's slack is 5 % with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, 12 % without (the plan prints the
allocated and the reserved peak, and the reserved one with the other setting).
With LoRA (model.lora; lora.py counts the adapters) the frozen base is held as sharded weights only: gradients,
AdamW state, the reduce-scatter input and the checkpoint are those of the adapters (and modules_to_save), the
gathered layers and root also hold the adapters, the lm_head gradient exists only when lm_head trains, and each
adapted layer keeps r values per token (plus its dropped input with dropout). With model.quantize nf4 (QLoRA) the
frozen decoder linears are held at lora.NF4_BYTES a weight, sharded and gathered, and the backward of a layer adds the
dequantization of the largest of them (lora.dequant_bytes); Answer.AI's published QLoRA peaks and a CPU run:
bench/RESULTS.md.
Host RAM per node while training on GPUs: each worker process (CUDA libraries, CUDA_PROCESS_BYTES), the
offloaded state with fsdp.cpu_offload, and with checkpoint.async_save the stager's pinned copy of the rank's
params + both AdamW moments, which it keeps between saves.
Measured on CPU (bench/plan_accuracy.py, the worker's load_model + train_step, glibc's default allocator as the
shipped profiles run it, an AVX-512 EPYC): the three quick cases land at +3..+9 %, +10 % and 0..+4 % of peak RSS
(--quick --repeat 5), the 16-case grid within -20..+14 % (--repeat 3; mean |error| 7.6 %; activation
checkpointing is planned low: recomputing churns the heap more than 30 % of the live bytes).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Literal

from fsdpjob.orchestrator.core.jobspec.profiles import ClusterProfile
from fsdpjob.orchestrator.core.units import GiB, count_text

from .lora import held_bytes, trainable
from .modelshape import ModelShape, ParamCount
from .moments import CPU_BF16_KERNEL_BYTES, Item, Moment, step_moments
from .setup import REDUCE_BYTES, Setup

__all__ = ["CPU_BF16_KERNEL_BYTES", "REDUCE_BYTES", "Item", "Moment", "Setup"]  # re-exported: their old home

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}

# The CUDA runtime item's parts (assumed; bench/gpu's device-used minus reserved checks their sum):
CUDA_CONTEXT_BYTES = int(0.5 * GiB)  # the context and the kernel images CUDA loads lazily
CUBLAS_WORKSPACE_BYTES = int(0.125 * GiB)  # cuBLAS + cuBLASLt workspaces (per handle and stream)
NCCL_COMMUNICATOR_BYTES = int(0.5 * GiB)  # one NCCL communicator's channel buffers (NVLS on NVSwitch can take more)
CPU_RUNTIME_BYTES = int(0.4 * GiB)  # python + torch + transformers per worker process (measured: 335 MiB)
# A CUDA torch worker's own RSS: the CUDA runtime, cuBLAS/cuDNN and NCCL libraries and their host buffers. Not
# measured here (no GPU lent yet): 1.5-3 GiB is the range CUDA torch processes show; the high end is planned.
CUDA_PROCESS_BYTES = 3 * GiB
# The caching allocator's reserved-over-allocated slack: blocks freed but not reusable for the next size. With
# PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (every shipped GPU profile sets it) segments grow in place and
# the slack is small: 5 %, the figure bench/gpu's worker runs land within 1 % of device-used memory with. Without
# it: 12 %, what Answer.AI's FSDP runs measured (Llama-2 7B LoRA, seq 2048: 10.22 GiB reserved over 9.16 GiB
# allocated; bench/plan_vs_published.py), against 5 % with them.
CUDA_FRAGMENTATION = 0.05
CUDA_FRAGMENTATION_PLAIN = 0.12
# glibc's default allocator keeps freed blocks (activations, gathered layers) in its heap for reuse: peak RSS
# runs 19-37 % above what the frozen-threshold measurement saw (bench/plan_accuracy.py --frozen). Modelled as
# slack on the live bytes rather than trading ~25 % of the step time for a tidy RSS (MALLOC_MMAP_THRESHOLD_).
CPU_FRAGMENTATION = 0.30
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
    other_fragmentation: float | None = None  # GPUs: the slack with the other expandable_segments setting

    @property
    def live(self) -> tuple[Item, ...]:
        """What is alive at the peak moment: the state and that moment's transients."""
        return (*self.state, *self.peak_moment.items)

    @property
    def allocated(self) -> int:
        """torch's allocated peak (max_memory_allocated): the live tensors at the peak moment."""
        return sum(i.bytes for i in self.live)

    @property
    def churned(self) -> int:
        """The live bytes at the peak the allocator's slack grows with: all but the kept items (Item.kept)."""
        return sum(i.bytes for i in self.live if not i.kept)

    @property
    def reserved(self) -> int:
        """torch's reserved peak (max_memory_reserved): allocated + the allocator's slack."""
        return self.allocated + int(self.fragmentation * self.churned)

    @property
    def reserved_other(self) -> int | None:
        """The reserved peak with the other expandable_segments setting (GPUs only)."""
        if self.other_fragmentation is None:
            return None
        return self.allocated + int(self.other_fragmentation * self.churned)

    @property
    def peak_moment(self) -> Moment:
        return max(self.moments, key=lambda mo: mo.bytes)

    @property
    def breakdown(self) -> tuple[Item, ...]:
        """What is alive at the peak: state, the peak moment's transients, runtime and fragmentation; sums to peak."""
        live = [i for i in self.live if i.bytes]
        kept = " but the kept buffers" if any(i.kept for i in live) else ""
        frag = Item("fragmentation", int(self.fragmentation * self.churned),
                    f"{self.fragmentation:.0%} of the above{kept}")
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
    state, moments = step_moments(s, p, u)
    if u.on_gpu:
        usable, where = usable_gpu_memory(profile)
        slack = (CUDA_FRAGMENTATION, CUDA_FRAGMENTATION_PLAIN)
        used, other = slack if u.expandable_segments else slack[::-1]
        return DeviceMemory("gpu", usable or None, tuple(state), tuple(moments), cuda_runtime(u), used, where, other)
    runtime = Item("process", CPU_RUNTIME_BYTES, "python + torch + transformers")
    budget = int(profile.host_ram_gb * GiB / u.tasks_per_node)
    return DeviceMemory("cpu", budget, tuple(state), tuple(moments), runtime, CPU_FRAGMENTATION)


def host_memory(s: ModelShape, p: ParamCount, u: Setup, profile: ClusterProfile, dev: DeviceMemory) -> HostMemory:
    """At load, each rank reads its own shards of safetensors weights (else rank 0 reads the checkpoint in its file
    dtype and broadcasts it tensor by tensor: _load_read_bytes); the shards live in host memory only on CPU workers
    or with CPU offload (on GPUs they are materialized on the device)."""
    tr = trainable(s, p, u.lora, u.quantize)
    shard_bytes = held_bytes(math.ceil(tr.weights / u.shard_degree), math.ceil(tr.quantized / u.shard_degree),
                             u.model_bytes)
    process_per_rank = CUDA_PROCESS_BYTES if u.on_gpu else CPU_RUNTIME_BYTES
    process = u.tasks_per_node * process_per_rank
    host_shards = u.tasks_per_node * shard_bytes * (not u.on_gpu or u.cpu_offload)
    trained_bytes = math.ceil(tr.trained / u.shard_degree) * u.model_bytes
    moments = math.ceil(tr.trained / u.shard_degree) * u.moment_bytes  # one AdamW moment
    # params + grads + 2 AdamW moments (of what trains)
    offloaded = (shard_bytes + trained_bytes + 2 * moments) * u.cpu_offload
    # DefaultStager keeps its (pinned) buffers between saves: the saved tensors, params + exp_avg + exp_avg_sq. On
    # CPU workers the device model (dev.peak, which is host RAM) does not hold it either, but the CPU plan is
    # left as measured (bench/plan_accuracy.py) until a staged CPU run is measured too.
    staged = (shard_bytes + 2 * moments) * (u.async_save and u.on_gpu)
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
    """Host RAM per node the memory tier holds (jobs/checkpoint/memory/tier.py): each rank's saved state (params + both
    AdamW moments of what trains) in shared memory, as much again for the replica it keeps of a rank of another
    node (none on one node), and the files of the step it last dropped, kept for the next snapshot to fill again
    (checkpoint/memory/node.py, keep_spares): twice the files, all the time. Nothing of the state's size lives in the
    rank's process: a snapshot copies straight into the mapped files and the replica travels between them."""
    if not u.memory_tier:
        return 0
    tr = trainable(s, p, u.lora)
    saved = (math.ceil(tr.weights / u.shard_degree) * u.model_bytes
             + 2 * math.ceil(tr.trained / u.shard_degree) * u.moment_bytes)
    return u.tasks_per_node * tier_rank_bytes(saved, multi_node=u.nodes > 1) + tier_small_files_bytes(s, u)


# A tensor chunk's entry in DCP's pickled .metadata (its chunk, its storage place; ~320 B measured on the
# quickstart model), and per rank and step its pickled entries (RNG, schedule, data position: ~15 KB) with the
# part file's block.
TIER_ENTRY_BYTES = 400
TIER_RANK_FILES_BYTES = 64 * 1024


def tier_small_files_bytes(s: ModelShape, u: Setup) -> int:
    """What a node's tier holds beside the tensors, for the committed step and the one in flight: the .metadata (an
    entry per rank's chunk of every tensor, each parameter with its 2 moments and the optimizer's step; a dense
    model's tensors, an upper bound under LoRA) and each rank's small entries. Megabytes against terabytes on a big
    model, but the whole of the tier's excess over the tensors on a small one (bench/memory_tier_kills.py)."""
    experts = max(s.experts, 1)
    tensors = s.layers * (6 + 3 * experts + (experts > 1)) + 3  # q k v o, 2 norms, the MLP's 3 (each expert's), router
    entries = 3 * tensors * u.world + tensors
    return 2 * (entries * TIER_ENTRY_BYTES + u.tasks_per_node * TIER_RANK_FILES_BYTES)


def tier_rank_bytes(saved: int, *, multi_node: bool) -> int:
    """One rank's part of memory_tier_bytes for ``saved`` bytes of saved state: its files (own + replica), twice."""
    copies = 2 if multi_node else 1  # own + replica
    return 2 * copies * saved


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
