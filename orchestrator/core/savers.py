"""The memory savers' shared rules (issue 41): what the worker runs and the planner counts, in one torch-free place.

The worker (jobs/) imports these to run the savers; the planner (planner/memory.py, timing.py) imports them to count
them, so the plan's terms and the worker's behaviour cannot drift apart.

- ``LOSS_CHUNK_TOKENS``: train.loss: chunked computes the cross-entropy over chunks of at most this many positions of
  the micro-batch's flattened [rows x seq] hidden states: one chunk's lm_head output, its fp32 upcast, log-softmax
  and their gradients exist at a time, and no logits are kept from the forward into the backward (each chunk's
  lm_head matmul is recomputed in backward, or its gradient computed in forward: either way one chunk at a time).
  1,024 positions at a 128K vocabulary is 0.25 GiB of bf16 logits per chunk (0.5 GiB in fp32): small beside the
  full-sequence logits of a 16K-token micro-batch (4 GiB bf16, 8 GiB fp32 each), still large enough that the
  chunk's matmul keeps a GPU busy (a [1024, hidden] x [hidden, vocab] GEMM). The worker's chunked loss
  (jobs/model/chunkedloss.CHUNK_TOKENS, issue 41's worker side) uses the same 1,024.
- ``checkpointed_layers``: model.selective_ac: N checkpoints every N-th decoder layer in full (torchtitan's rule:
  the N-th, 2N-th, ... layer, counted from 1) and keeps the others' activations.
- ``SELECTIVE_OP_KEEPS``: model.selective_ac: op is torchtitan's op policy: a decoder layer keeps the attention
  kernel's output (and logsumexp) and every other matmul's output, counted from the layer's first (q, k, v, o,
  gate, up, down: q, v, gate and down are kept; k, o and up recomputed; a plain MLP's up is kept, its down
  recomputed) and recomputes the rest (norms, RoPE, the activation function and products, residual adds).
- ``nf4_scaler_block`` and ``nf4_shard_problem``: model.quantize: nf4 (QLoRA) cuts each 4-bit weight into blocks of
  ``NF4_BLOCK`` weights with a scale each, the scales double-quantized in groups; FSDP2 shards the codes by whole
  rows and cannot pad them, so a shard must hold whole rows and whole scale groups. The worker
  (jobs/model/quantize.py) quantizes by these rules; the plan refuses a world size they do not divide.
"""

from __future__ import annotations

LOSS_CHUNK_TOKENS = 1024

SELECTIVE_OP_KEEPS = ("q_proj", "v_proj", "attention", "gate_proj", "down_proj")


def checkpointed_layers(layers: int, every: int) -> tuple[int, ...]:
    """The indices (from 0) of the decoder layers model.selective_ac: ``every`` checkpoints in full."""
    return tuple(i for i in range(layers) if (i + 1) % every == 0)


NF4_BLOCK = 64  # weights per 4-bit block, one scale each (the QLoRA paper's, and torchao's default)
NF4_SCALER_BLOCK = 256  # block scales per double-quantization group (the paper's and torchao's default)
NF4_MIN_GROUPS = 8  # scale groups come in multiples of this (a shard holds whole groups)


def nf4_scaler_block(numel: int) -> int:
    """The double-quantization group of a weight of ``numel`` elements: 256 scales, or the largest power of two
    below that divides its block count into a multiple of NF4_MIN_GROUPS groups (so that it shards over 1, 2, 4
    and 8 ranks, and over more where the count allows). It depends on the shape only, never on the world size, so
    the 4-bit base is the same on any number of ranks."""
    blocks = numel // NF4_BLOCK
    size = NF4_SCALER_BLOCK
    while size > 1 and (blocks % size or (blocks // size) % NF4_MIN_GROUPS):
        size //= 2
    return size


def nf4_shard_problem(rows: int, columns: int, shards: int) -> str | None:
    """Why a rows x columns weight cannot be held in 4 bits over ``shards`` FSDP2 shards, or None."""
    numel = rows * columns
    groups = numel // NF4_BLOCK // nf4_scaler_block(numel) if numel % NF4_BLOCK == 0 else 0
    if numel % NF4_BLOCK == 0 and rows % shards == 0 and groups % shards == 0:
        return None
    return (f"a {rows} x {columns} weight cannot be cut into {shards} shards of whole 4-bit blocks (its size must "
            f"be a multiple of {NF4_BLOCK}, its rows and its {groups} scale groups of {shards})")
