"""The planner's time model: one optimizer step, one checkpoint save, and the signal lead that covers a stop.

Units. Checkpoint sizes and storage bandwidth are decimal GB.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from fsdpjob.orchestrator.core.flops import forward_flops_per_token, peak_flops, train_flops_per_token
from fsdpjob.orchestrator.core.jobspec.profiles import ClusterProfile
from fsdpjob.orchestrator.core.stopping import stop_wait_s
from fsdpjob.orchestrator.core.units import GB, count_text

from .activations import recomputed_flops_share
from .lora import trainable
from .memory import Setup
from .modelshape import ModelShape, ParamCount
from .moe import inactive_params
from .moments import loss_positions

MFU = 0.40  # assumed model FLOPs utilisation on GPUs
# model.compile: compiled blocks fuse the elementwise work. torchtitan measured 1.157x tokens/s at Llama 3.1 8B on
# 8 H100 (5,762 -> 6,667, selective AC; benchmarks/llama3_h100_202412_torchtitan.md); fsdpjob's own 1.2B run on an
# H200 gained more (1.52x, most of it the varlen path's fused transposes: bench/RESULTS.md). The smaller is planned.
COMPILE_SPEEDUP = 1.157
# Achieved FLOP/s per CPU core on the dev machine (374M Llama, FSDP2 on gloo, one thread per rank).
CPU_FLOPS_PER_CORE = {2: 53e9, 4: 31e9}
# FSDP2 prefetches the next layer's all-gather and overlaps the reduce-scatters with the backward. Without the
# profile's fabric_bandwidth_gbps no communication term is added; said with every GPU step time.
COMMUNICATION = "communication assumed hidden behind compute (no fabric bandwidth modelled)"
SIGNAL_MARGIN_S = 10  # the lead must cover the wait for the ranks' agreement + a save + this (or 25 %)
# After the stop checkpoint: the workers exit, srun's step ends, and the supervisor asks scontrol what the stop
# was and requeues (slurm/stop.py). The stop event's handoff_s: 1-4.4 s on the 2-core dev cluster under a test
# run; twice that here, since the requeue must land before the time limit.
STOP_HANDOFF_S = 10


@dataclass(frozen=True)
class Timing:
    checkpoint_bytes: int
    save_s: float
    flops_per_rank: float  # one optimizer step
    flops_per_s: float | None  # assumed per rank; None: unknown device
    throughput_note: str
    signal_lead_s: int
    comm_s: float | None = None  # one step's collectives over the fabric (None: not modelled)
    generation_s: float | None = None  # grpo in-process: the generation of one optimizer step's completions

    @property
    def compute_s(self) -> float | None:
        return self.flops_per_rank / self.flops_per_s if self.flops_per_s else None

    @property
    def step_s(self) -> float | None:
        """Compute, or the fabric's time where that is longer: FSDP2 overlaps the two, so the longer one bounds."""
        compute = self.compute_s
        train = max(compute, self.comm_s or 0.0) if compute is not None else None
        return train + (self.generation_s or 0.0) if train is not None else None

    @property
    def needed_lead_s(self) -> int:
        """Seconds of warning that cover the wait before a stop (core/stopping.py: up to two steps and the
        ranks' agreement interval), one save, the hand-off to the supervisor's requeue and a margin (rounded up
        to 10 s)."""
        work = stop_wait_s(self.step_s or 0.0) + self.save_s + STOP_HANDOFF_S
        return int(math.ceil((work + max(SIGNAL_MARGIN_S, 0.25 * work)) / 10) * 10)


def _throughput(u: Setup, profile: ClusterProfile, cpus_per_task: int | None) -> tuple[float | None, str]:
    c = u.compute_bytes
    dtype = "bf16" if c == 2 else "fp32"
    if not u.on_gpu:
        cores = cpus_per_task or 1
        rate = CPU_FLOPS_PER_CORE[c] * cores
        basis = f"{count_text(cores, 'core')} x {CPU_FLOPS_PER_CORE[c] / 1e9:.0f}, {dtype}, measured on CPU"
        return rate, f"{rate / 1e9:.0f} GFLOP/s per rank ({basis})"
    peak = peak_flops(profile.gpu_type or "", c)  # dense, by compute dtype: core/flops.PEAK_FLOPS
    if peak is None:
        return None, f"unknown for gpu_type {profile.gpu_type!r}"
    speedup = COMPILE_SPEEDUP if u.compile else 1.0
    compiled = f" x {speedup:g} for compiled blocks" if u.compile else ""
    return (peak * MFU * speedup,
            f"{MFU:.0%} MFU of {peak / 1e12:.0f} TFLOP/s {dtype} ({profile.gpu_type}){compiled}; {COMMUNICATION}")


def fabric_bytes(u: Setup, weights: int, trained: int) -> int:
    """Bytes one optimizer step moves over the inter-node fabric, per node (0 on one node: NVLink, hidden).

    A ring collective of S bytes over W ranks moves S x (W-1)/W through each node's NICs. Per micro-batch FSDP2
    all-gathers the weights in the compute dtype for the forward and, when the layers reshard after it, again for
    the backward; the fp32 reduce-scatter of the gradients runs per micro-batch, or once a step when gradient sync
    is deferred. With HSDP the gathers and reduce-scatters stay within a shard group (on one node when it fits
    there) and the replicas all-reduce the gradient shards (2 x (R-1)/R)."""
    if u.nodes <= 1:
        return 0
    gathers = (2 if u.reshard else 1) * weights * u.compute_bytes * u.grad_accum
    reduces = trained * u.reduce_bytes * (1 if u.defer_grad_sync else u.grad_accum)
    shard, replicas = u.shard_degree, u.replicate_degree
    moved = 0.0
    if shard > u.tasks_per_node:  # the shard group spans nodes
        moved += (gathers + reduces) * (shard - 1) / shard
    if replicas > 1:
        syncs = 1 if u.defer_grad_sync else u.grad_accum
        moved += 2 * trained * u.reduce_bytes / shard * (replicas - 1) / replicas * u.tasks_per_node * syncs
    return int(moved)


def _communication(u: Setup, weights: int, trained: int, profile: ClusterProfile, compute_s: float | None
                   ) -> tuple[float | None, str]:
    """(seconds of fabric time per step, the note said with the step time) for a GPU plan."""
    bandwidth = profile.fabric_bandwidth_gbps
    if u.nodes <= 1:
        return None, "one node: collectives over NVLink, assumed hidden behind compute"
    if bandwidth is None:
        return None, COMMUNICATION
    comm = fabric_bytes(u, weights, trained) / (bandwidth * GB)
    how = "hidden behind compute" if compute_s is not None and comm <= compute_s else "longer than compute: the " \
        "step is bound by the fabric"
    return comm, f"collectives {comm:.2g} s per step over the fabric at {bandwidth:g} GB/s per node, {how}"


def plan_timing(s: ModelShape, p: ParamCount, u: Setup, profile: ClusterProfile, cpus: int | None, lead: int) -> Timing:
    tr = trainable(s, p, u.lora)
    # The embedding lookup does no matmul; MoE: a token runs through top_k of the routed experts (planner/moe.py).
    matmul_params = tr.weights - (0 if s.tied else p.embedding) - inactive_params(s)
    trained = tr.trained if tr.is_lora else max(tr.trained - inactive_params(s), 0)
    per_token = train_flops_per_token(matmul_params=matmul_params, trained_params=trained, layers=s.layers,
                                      q_dim=s.q_dim, seq_len=u.seq_len)
    # Recomputation: the checkpointed layers' forward again (op-level selective AC recomputes no matmul), and the
    # chunked loss's lm_head matmul, chunk by chunk in backward.
    layer_forward = forward_flops_per_token(matmul_params, s.layers, s.q_dim, u.seq_len) - 2 * s.vocab * s.hidden
    per_token += layer_forward * recomputed_flops_share(s, u)
    if u.chunked_loss and loss_positions(u) < u.rows * u.seq_len:
        per_token += 2 * s.vocab * s.hidden
    # Every position of every row: the step's time. The worker's tokens_per_s and mfu count the non-pad positions
    # of the same rows (metrics.py), which boundary-aware packing keeps within its padding share (the data event's
    # packing_efficiency) of these; unpacked rows of short examples fall further below.
    tokens = u.rows * u.grad_accum * u.seq_len
    if u.reference_copy:
        per_token += forward_flops_per_token(matmul_params, s.layers, s.q_dim, u.seq_len)  # the reference's forward
    rate, note = _throughput(u, profile, cpus)
    comm = None
    if u.on_gpu and rate is not None:
        comm, said = _communication(u, tr.weights, tr.trained, profile, per_token * tokens / rate)
        note = note.replace(COMMUNICATION, said)
    generation = _generation_s(s, u, tr.weights, matmul_params, rate, profile) if u.generation_rows else None
    # params + exp_avg + exp_avg_sq, of what trains (the base is not saved)
    ckpt = tr.trained * (u.model_bytes + 2 * u.moment_bytes)
    save = ckpt / (profile.storage_bandwidth_gbps * GB * u.nodes)
    return Timing(ckpt, save, per_token * tokens, rate, note, lead, comm, generation)


def _generation_s(s: ModelShape, u: Setup, weights: int, matmul_params: int, rate: float | None,
                  profile: ClusterProfile) -> float | None:
    """grpo's in-process generation per optimizer step: its forward FLOPs over prompt and completion at the
    training rate, plus, across nodes, one all-gather of the weights per generated token (FSDP2 gathers every
    layer at each decode step). Decoding is bound by memory bandwidth more than FLOPs: a lower bound."""
    if rate is None:
        return None
    flops = u.generation_rows * u.seq_len * forward_flops_per_token(matmul_params, s.layers, s.q_dim, u.seq_len)
    seconds = flops / rate
    bandwidth = profile.fabric_bandwidth_gbps
    if u.on_gpu and u.nodes > 1 and bandwidth and u.shard_degree > u.tasks_per_node:
        gathered = weights * u.compute_bytes * (u.shard_degree - 1) / u.shard_degree
        seconds += u.generation_tokens * gathered / (bandwidth * GB)
    return seconds  # a round of K steps generates K steps' shares, one call per share: the same per step


# Tokenizing on the workers (jobs/data: one example at a time through the fast tokenizer, then packing), measured
# on this project's 2-core CI machine at a load average of 18 with the quickstart tokenizer: 1,058 examples/s
# (200,000 examples of 24 bytes in 189 s). Per-example cost dominates short examples; the plan takes that rate as
# a floor, and JSONL examples are counted from the mean line length of each file's first MiB.
TOKENIZE_EXAMPLES_PER_S = 1000.0
UNCOUNTED_EXAMPLE_BYTES = 1024  # parquet and save_to_disk: examples taken as this many bytes each
_SAMPLE = 1 << 20


def setup_work_s(spec, profile: ClusterProfile) -> float:
    """A first start's set-up work beyond imports and process groups: the weights read at the storage bandwidth
    (rank 0 of a node reads them all, the worst case) and the data tokenized once (jobs/data/cache.py) at the
    measured rate. Files that cannot be read here count nothing (plan before the download)."""
    from pathlib import Path

    from fsdpjob.orchestrator.core.inputs.dataformats import SourceProblem, locate
    from fsdpjob.orchestrator.core.weightfiles import weight_files

    try:
        weights = sum(f.stat().st_size for f in weight_files(Path(spec.model.path)) or [] if f.is_file())
    except (OSError, ValueError):  # an index that is not JSON yet (a download in progress): counts nothing
        weights = 0
    examples = 0.0
    for source in spec.data.inputs():
        try:
            located = locate(source)
        except (SourceProblem, OSError):
            continue
        examples += sum(_examples_in(f, located.format) for f in located.files if f.is_file())
    return weights / (profile.storage_bandwidth_gbps * GB) + examples / TOKENIZE_EXAMPLES_PER_S


def _examples_in(path, fmt: str) -> float:
    size = path.stat().st_size
    if fmt != "jsonl":
        return size / UNCOUNTED_EXAMPLE_BYTES
    with open(path, "rb") as f:
        head = f.read(_SAMPLE)
    lines = head.count(b"\n") or 1
    return size / (len(head) / lines)
