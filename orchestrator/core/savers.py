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
"""

from __future__ import annotations

LOSS_CHUNK_TOKENS = 1024

SELECTIVE_OP_KEEPS = ("q_proj", "v_proj", "attention", "gate_proj", "down_proj")


def checkpointed_layers(layers: int, every: int) -> tuple[int, ...]:
    """The indices (from 0) of the decoder layers model.selective_ac: ``every`` checkpoints in full."""
    return tuple(i for i in range(layers) if (i + 1) % every == 0)
