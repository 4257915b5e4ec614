"""Preflight planner: parameter count from config.json, per-rank and per-node memory, checkpoint and step time.

Pure arithmetic on the login node: reads the model folder's ``config.json`` only (never weights) and imports
neither torch nor transformers. ``make_plan(spec, profile)`` returns a :class:`Plan`; ``format_plan`` renders it
as a text table and ``Plan.to_json()`` as a dict with stable keys (documented on the method).

Units. Memory is in bytes internally and shown in GiB: a profile's ``gpu_memory_gb`` and ``host_ram_gb`` are read
as GiB (an "80GB" A100 has 80 GiB; Slurm's ``G`` is GiB). Checkpoint sizes and storage bandwidth are decimal GB.

Recipe modelled (the worker's): FSDP2 ``fully_shard`` on every decoder layer, then on the root (embeddings,
final norm, lm_head; the root keeps its parameters gathered from forward to the end of backward), meta-device
init, mixed precision ``param_dtype`` = compute dtype with gradients reduced in fp32, AdamW with
``fused=True`` (no optimizer-sized temporaries; torch's default foreach AdamW on CUDA would add one more
``model.dtype`` copy of the shard, 4 bytes/param/shard in fp32), ``loss = model(...).loss`` (logits not kept).

Per-rank peak = sharded state + the largest of four moments of a step (steady state, optimizer state exists):
  * forward end: all saved activations + the loss's logits (12 bytes per token x vocab: fp32 log-softmax
    output and the two fp32 gradients in its backward), root gathered;
  * backward, last layer: saved activations + that layer's gathered params (current + prefetched next),
    its unsharded gradients, the previous layer's fp32 reduce-scatter input, its gradient working set,
    the root gathered and the lm_head gradient (held until the root's reduce-scatter at the very end);
  * backward end: all sharded gradients + the root's unsharded gradients and fp32 reduce-scatter input;
  * optimizer step: all sharded gradients (fused AdamW adds nothing).
Saved activations per layer and token, compute dtype c bytes (2 bf16, 4 fp32), with sdpa / flash attention:
  2 RMSNorms x (4 + 2c) h  (fp32 upcast kept for backward, normalized and output)
  + 3c q_dim + 2c kv_dim   (q, k after RoPE, v for attention; attention output and its contiguous copy for o_proj)
  + 4c intermediate        (gate, silu(gate), up, gate*up for SwiGLU)
eager attention instead keeps q, repeated k/v and output (4c q_dim) plus micro_batch x heads x seq^2 x (4 + c)
(fp32 softmax and its compute-dtype copy). Activation checkpointing keeps each layer's input (c h per token)
and recomputes one layer at a time in backward.

The golden seed case (Llama-2-70B, 68.98e9 params, fp32 master weights, bf16 compute, AC, seq 2048, mb 1):
  * 2 nodes x 8 A100-80GB: params + grads + AdamW = 16 B x 68.98e9 / 16 = 69.0e9 B (64.2 GiB); the backward end
    adds the root's 0.52e9 unsharded gradients (2 B) and fp32 reduce-scatter input (4 B) = 3.1e9 B; with the
    CUDA context (1 GiB) and 5 % fragmentation the peak is about 71.8 GiB < 80 GiB: FITS.
  * 1 node x 8: 16 B x 68.98e9 / 8 = 138e9 B (128.5 GiB) of state alone: does not fit; CPU offload (about
    9 GiB left on the GPU, 1.1 TB on the host) or a 2nd node fix it.
  * host RAM at load: every rank loading fp32 = 8 x 4 B x 68.98e9 = 2.2e12 B per node; rank-0 loading = one
    fp16 copy (checkpoint dtype, 138e9 B) + 8 fp32 shards (8 x 17.2e9 B) = 0.28e12 B.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from .errors import InputError
from .profiles import ClusterProfile
from .resolve import effective
from .spec import JobSpec

GiB = 1024**3
GB = 10**9

# Model types whose decoder layer is Llama-shaped: q/k/v/o attention with GQA, SwiGLU gate/up/down MLP,
# two RMSNorms per layer, final RMSNorm, optional tied lm_head.
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "granite")
# Keys a config.json may omit; the values are each transformers config class's defaults.
_TIED_DEFAULT = {"llama": False, "mistral": False, "qwen2": False, "qwen3": False, "granite": False}
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
REDUCE_BYTES = 4  # gradients are reduce-scattered in fp32 whatever the compute dtype

CUDA_RUNTIME_BYTES = 1 * GiB  # CUDA context (~0.5-0.8 GiB) + NCCL communicator buffers
CPU_RUNTIME_BYTES = int(0.4 * GiB)  # python + torch + transformers per worker process (measured: 335 MiB)
CUDA_FRAGMENTATION = 0.05  # caching-allocator blocks freed but not reusable for the next size
CPU_FRAGMENTATION = 0.05  # glibc arenas keep freed chunks resident
MFU = 0.40  # assumed model FLOPs utilisation on GPUs
# Dense peak FLOP/s per GPU by compute dtype (bf16 tensor cores; fp32 without TF32, torch's default for matmul).
GPU_PEAK_FLOPS = {"a100": {2: 312e12, 4: 19.5e12}, "h100": {2: 989e12, 4: 67e12}, "h200": {2: 989e12, 4: 67e12}}
# Achieved FLOP/s per CPU core on the dev machine (374M Llama, FSDP2 on gloo, one thread per rank).
CPU_FLOPS_PER_CORE = {2: 53e9, 4: 31e9}
SIGNAL_MARGIN_S = 30  # the lead must cover a step + a save + this (or 20 %, whichever is larger)


# ------------------------------------------------------------------------------------------------
# The model: shape from config.json and parameter counts.


@dataclass(frozen=True)
class ModelShape:
    model_type: str
    vocab: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    tied: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    checkpoint_dtype: str

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim


@dataclass(frozen=True)
class ParamCount:
    embedding: int
    attention: int  # per layer
    mlp: int  # per layer
    norms: int  # per layer
    layers: int
    final_norm: int
    lm_head: int  # 0 when tied to the embedding

    @property
    def per_layer(self) -> int:
        return self.attention + self.mlp + self.norms

    @property
    def root(self) -> int:
        """Parameters the root FSDP unit owns: embedding, final norm, untied lm_head."""
        return self.embedding + self.final_norm + self.lm_head

    @property
    def total(self) -> int:
        return self.root + self.layers * self.per_layer


def _config_error(path: Path, message: str) -> InputError:
    return InputError(message, file=str(path), loc="model.path")


def read_model_shape(model_dir: str | Path) -> ModelShape:
    """Parse ``<model_dir>/config.json``; refuse model types whose layer shape the planner does not know."""
    path = Path(model_dir) / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except FileNotFoundError:
        raise _config_error(path, "not found; model.path must be a Hugging Face model folder with config.json") from None
    except json.JSONDecodeError as exc:
        raise _config_error(path, f"line {exc.lineno}: not valid JSON ({exc.msg})") from None
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise _config_error(
            path,
            f"model_type {model_type!r} is not supported by the planner; supported: {', '.join(SUPPORTED_MODEL_TYPES)}",
        )

    def need(key: str) -> int:
        if not isinstance(cfg.get(key), int):
            raise _config_error(path, f"{key} is missing or not an integer")
        return cfg[key]

    heads = need("num_attention_heads")
    hidden = need("hidden_size")
    attention_bias = bool(cfg.get("attention_bias", False))
    return ModelShape(
        model_type=model_type,
        vocab=need("vocab_size"),
        hidden=hidden,
        intermediate=need("intermediate_size"),
        layers=need("num_hidden_layers"),
        heads=heads,
        kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or hidden // heads,
        tied=bool(cfg.get("tie_word_embeddings", _TIED_DEFAULT[model_type])),
        qkv_bias=model_type == "qwen2" or attention_bias,  # qwen2 always has q/k/v biases, never o
        o_bias=attention_bias and model_type != "qwen2",
        mlp_bias=bool(cfg.get("mlp_bias", False)) and model_type in ("llama", "granite"),
        qk_norm=model_type == "qwen3",
        checkpoint_dtype=str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32"),
    )


def count_params(s: ModelShape) -> ParamCount:
    h = s.hidden
    attention = h * s.q_dim + 2 * h * s.kv_dim + s.q_dim * h
    attention += (s.q_dim + 2 * s.kv_dim) * s.qkv_bias + h * s.o_bias + 2 * s.head_dim * s.qk_norm
    mlp = 3 * h * s.intermediate + (2 * s.intermediate + h) * s.mlp_bias
    return ParamCount(
        embedding=s.vocab * h,
        attention=attention,
        mlp=mlp,
        norms=2 * h,
        layers=s.layers,
        final_norm=h,
        lm_head=0 if s.tied else s.vocab * h,
    )


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
    """The sharded state (device-resident part) and the four moments' transient items, per rank."""
    m, c, r, w = u.model_bytes, u.compute_bytes, REDUCE_BYTES, u.shard_degree
    t = u.micro_batch * u.seq_len
    shard = math.ceil(p.total / w)
    state = [
        Item("parameters", shard * m, f"{p.total:,} params x {m} B / {w} shards"),
        Item("gradients", shard * m, f"sharded, {m} B"),
        Item("AdamW state", 2 * shard * m, f"exp_avg + exp_avg_sq, {m} B each"),
    ]
    if u.cpu_offload:
        state = [Item(i.name, 0, "offloaded to host memory") for i in state]
    grads = state[1].bytes
    early_grads = Item("gradients (accumulating)", grads if u.grad_accum > 1 else 0, "held across micro-batches")
    layer_acts, working = _layer_activations(s, u)
    per_layer_saved = t * s.hidden * c if u.activation_checkpointing else layer_acts
    saved = Item(
        "activations",
        s.layers * per_layer_saved + (4 + 3 * c) * t * s.hidden,
        f"{s.layers} layers x {per_layer_saved / GiB:.3g} GiB" + (" (layer inputs, AC)" if u.activation_checkpointing else ""),
    )
    root = Item("root gathered", p.root * c, "embedding + final norm + lm_head, compute dtype")
    head_grad = Item("lm_head gradient", s.vocab * s.hidden * c, "unsharded until the root's reduce-scatter")
    big = p.per_layer
    gathered = (3 * c if w > 1 else 2 * c) * big
    layer = [
        Item("layer gathered", gathered, "params + unsharded grads" + (" + prefetched next layer" if w > 1 else "")),
        Item("reduce-scatter buffer", r * big, "previous layer's fp32 reduce-scatter input"),
        Item("layer working set", working + (layer_acts if u.activation_checkpointing else 0),
             "activation gradients" + (" + recomputed layer" if u.activation_checkpointing else "")),
    ]
    moments = [
        Moment("forward end (loss)", (early_grads, saved, root, Item("logits", 12 * t * s.vocab, "fp32 log-softmax + grads"))),
        Moment("backward, last layer", (early_grads, saved, root, head_grad, *layer)),
        Moment("backward end", (Item("gradients", grads), Item("root gradients", p.root * (c + r), "unsharded + fp32 reduce-scatter input"))),
        Moment("optimizer step", (Item("gradients", grads),)),
    ]
    return state, moments
