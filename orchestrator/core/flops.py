"""Training FLOPs per token: the one formula the planner's step time and the worker's MFU share (no torch)."""

from __future__ import annotations


def train_flops_per_token(*, matmul_params: int, trained_params: int, layers: int, q_dim: int, seq_len: int,
                          recompute: bool = False) -> float:
    """Forward + backward FLOPs of one token.

    Forward: 2 per matmul weight (the input embedding lookup is none; a tied output projection is) plus causal
    attention, half of 4 x layers x seq_len x q_dim for QK^T and AV. Backward: twice the forward, less the weight
    gradients of frozen weights (LoRA's base: ~4N where full training is 6N). ``recompute``: activation
    checkpointing runs the forward twice (hardware FLOPs for a step time; MFU leaves it out).
    """
    forward = 2 * matmul_params + 2 * layers * seq_len * q_dim
    per_token = 3 * forward - 2 * max(matmul_params - trained_params, 0)
    return float(per_token + forward * recompute)
