"""What each decoder layer keeps from its forward for its backward, and what it recomputes: no checkpointing,
full, selective (op-level or every N-th layer), eager or compiled.

Saved activations per layer and token, with sdpa / flash attention, eager blocks:
  2 RMSNorms x (4 + 2c) h  (fp32 upcast kept for backward, normalized and output)
  + 3c q_dim + 2c kv_dim   (q, k after RoPE, v for attention; attention output and its contiguous copy for o_proj)
  + 4c intermediate        (gate, silu(gate), up, gate*up for SwiGLU)
eager attention instead keeps q, repeated k/v and output (4c q_dim) plus micro_batch x heads x seq^2 x (4 + c)
(fp32 softmax and its compute-dtype copy).

model.compile (each block compiled by inductor): the partitioner keeps a fused norm's input and output and
recomputes its fp32 upcast (2c h per norm instead of (4 + 2c) h), and keeps the MLP's gate and up outputs,
recomputing silu(gate) and the product (2c intermediate instead of 4c): the elementwise outputs are cheap to
recompute and it saves the fewest bytes. Nothing else changes: the matmul and attention outputs stay saved.
(torch.compile of the loss, as torchtitan and torchtune do, also fuses the logits' fp32 upcast; the worker compiles
the blocks only, so the plan counts no such saving.)

Full activation checkpointing keeps each layer's input (c h per token) and recomputes one layer at a time in
backward. Selective, op-level (core/savers.SELECTIVE_OP_KEEPS, torchtitan's op policy) keeps the layer's input,
the attention kernel's output and every other matmul's output, counted from the layer's first:
  c (h + 2 q_dim + kv_dim + intermediate + h) + 4 heads  (input; q and v; attention output and its fp32
  logsumexp; gate and down projections, or the up projection of a plain MLP)
and recomputes the rest of the layer in backward (k, o and up projections among it).
Selective every-N (core/savers.checkpointed_layers)
checkpoints every N-th layer in full and keeps the others' activations.
"""

from __future__ import annotations

from fsdpjob.orchestrator.core.savers import checkpointed_layers

from .lora import adapter_activations
from .modelshape import ModelShape
from .moe import is_moe, mlp_width, moe_mlp_activations
from .setup import Setup


def layer_activations(s: ModelShape, u: Setup) -> tuple[int, int]:
    """(bytes one layer keeps for backward without checkpointing, bytes of its gradient working set) for one
    micro-batch."""
    c, t, b = u.compute_bytes, u.rows * u.seq_len, u.rows
    fused = u.compile and u.attn != "eager"
    norms = 2 * (2 * c if fused else 4 + 2 * c) * s.hidden
    # the MLP: one, or top_k routed experts + shared ones + router + permute buffers (planner/moe.py)
    per_token = norms + (moe_mlp_activations(s, c, fused) if is_moe(s) else (2 if fused else 4) * c * s.intermediate)
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
    working = max(3 * c * t * mlp_width(s), b * s.heads * u.seq_len**2 * (4 + 2 * c) if u.attn == "eager" else 0)
    mask = b * u.seq_len**2 if u.dense_mask else 0  # the bool mask itself, shared by the layers
    return t * per_token + scores, working + 2 * 4 * t * s.hidden + mask


def op_kept(s: ModelShape, u: Setup) -> int:
    """Bytes one layer keeps with op-level selective checkpointing: its input, the attention output and every
    other matmul's output."""
    c, t, b = u.compute_bytes, u.rows * u.seq_len, u.rows
    # Every other matmul, counted from the layer's first (q, k, v, o, [gate,] up, down): q, v and gate + down, or up.
    mlp = mlp_width(s) + (s.hidden if s.gated_mlp else 0)
    per_token = c * (s.hidden + 2 * s.q_dim + s.kv_dim + mlp) + 4 * s.heads
    per_token += adapter_activations(s, u.lora, c)  # the adapters' A outputs are matmul outputs too
    scores = 0
    if u.attn == "eager":
        scores = b * s.heads * u.seq_len**2 * c  # QK^T is a matmul: kept; the softmax is recomputed from it
    elif u.dense_mask:
        scores = b * u.seq_len**2 * c
    return min(t * per_token + scores, layer_activations(s, u)[0])


def layer_mode(s: ModelShape, u: Setup, index: int) -> str:
    """How layer ``index`` (from 0) keeps its activations: "none", "full" or "op"."""
    if u.activation_checkpointing:
        return "full"
    if u.selective_ac == "op":
        return "op"
    if isinstance(u.selective_ac, int):
        return "full" if index in checkpointed_layers(s.layers, u.selective_ac) else "none"
    return "none"


def kept(s: ModelShape, u: Setup, index: int) -> int:
    """Bytes layer ``index`` keeps from its forward for its backward."""
    mode = layer_mode(s, u, index)
    if mode == "full":
        return u.rows * u.seq_len * s.hidden * u.compute_bytes
    return op_kept(s, u) if mode == "op" else layer_activations(s, u)[0]


def all_kept(s: ModelShape, u: Setup) -> int:
    """Bytes every decoder layer together keeps (the layers differ only with selective every-N)."""
    if not isinstance(u.selective_ac, int) or u.activation_checkpointing:
        return s.layers * kept(s, u, 0)
    full = len(checkpointed_layers(s.layers, u.selective_ac))
    return full * kept(s, u, u.selective_ac - 1) + (s.layers - full) * layer_activations(s, u)[0]


def recomputed(s: ModelShape, u: Setup, index: int) -> int:
    """Bytes layer ``index`` rebuilds in its backward (on top of what it kept): the whole layer's activations
    when checkpointed in full, the non-matmul outputs with op-level selective checkpointing, none otherwise."""
    mode = layer_mode(s, u, index)
    if mode == "none":
        return 0
    full = layer_activations(s, u)[0]
    return full if mode == "full" else max(full - op_kept(s, u), 0)


def recomputed_flops_share(s: ModelShape, u: Setup) -> float:
    """The share of one forward that the backward runs again: 1 with full checkpointing; the checkpointed share of
    layers with every-N; op-level recomputes every other matmul of the layers (k, o, up projections): their share."""
    if u.activation_checkpointing:
        return 1.0
    if isinstance(u.selective_ac, int):
        return len(checkpointed_layers(s.layers, u.selective_ac)) / s.layers
    if u.selective_ac == "op":
        recomputed_mm = s.kv_dim + s.q_dim + (s.intermediate if s.gated_mlp else 0)  # k, o, up (per hidden unit)
        every_mm = 2 * s.q_dim + 2 * s.kv_dim + (3 if s.gated_mlp else 2) * s.intermediate
        return recomputed_mm / every_mm
    return 0.0
