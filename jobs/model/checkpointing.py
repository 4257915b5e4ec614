"""Activation checkpointing of the decoder blocks: none, full, or selective (spec model.activation_checkpointing and
model.selective_ac), as torchtitan does it (torchtitan/distributed/activation_checkpoint.py).

- full: every block is recomputed in the backward from its input; the forward keeps one hidden state per block.
- selective ``op``: every block runs under torch.utils.checkpoint with a selective policy (torch's
  ``create_selective_checkpoint_contexts``): the outputs of the expensive ops are kept (the attention kernel's,
  and every other matmul's), the rest (norms, rotary, activation functions, elementwise products, the other
  matmuls) recomputed. torchtitan's ``op`` option saves exactly this: all of its save list but every second
  ``aten.mm`` of a block (counted per forward, the recompute counting alone), which in a Llama block keeps
  q, v, gate and down projections' outputs and recomputes k, o and up. The planner counts the same.
- selective ``N``: every N-th block (the N-th, 2N-th ..., counted from 1 as torchtitan counts) checkpointed in
  full, the others keep everything.

Recomputation replays the same ops on the same inputs, so on a deterministic backend every variant gives the
plain path's loss and gradients bitwise (tests/worker/test_savers.py).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

Mode = Literal["none", "full", "selective"]


@dataclass(frozen=True)
class Checkpointing:
    """What activation checkpointing the blocks get: the spec's two fields, checked once."""

    mode: Mode = "none"
    selective_ac: Literal["op"] | int = "op"  # with mode selective: op-level, or every N-th block

    def __post_init__(self) -> None:
        if self.mode not in ("none", "full", "selective"):
            raise ValueError(f"activation checkpointing {self.mode!r} is not one of none, full, selective")
        every = self.selective_ac
        if every != "op" and (isinstance(every, bool) or not isinstance(every, int) or every < 1):
            raise ValueError(f"selective_ac {every!r} is neither op nor a positive number of blocks")

    @classmethod
    def of(cls, mode: Mode, selective_ac: Literal["op"] | int = "op") -> Checkpointing:
        """The spec's model.activation_checkpointing and model.selective_ac (ModelSpec validated them)."""
        return cls(mode, selective_ac)

    @property
    def any(self) -> bool:
        return self.mode != "none"

    @property
    def op_level(self) -> bool:
        return self.mode == "selective" and self.selective_ac == "op"

    def checkpoints_block(self, index: int) -> bool:
        """Whether block ``index`` (from 0) is wrapped at all (op-level wraps every block, selectively)."""
        if self.mode == "none":
            return False
        if self.mode == "full" or self.selective_ac == "op":
            return True
        return (index + 1) % int(self.selective_ac) == 0


NONE, FULL = Checkpointing("none"), Checkpointing("full")


def _ops(*names: str) -> frozenset:
    """The op overloads this torch has among ``names`` ("namespace.op.overload"); a build without one (no CUDA
    kernels, an older torch without varlen attention) simply never dispatches it."""
    found = []
    for name in names:
        space, op, overload = name.split(".")
        packet = getattr(getattr(torch.ops, space), op, None)
        if packet is not None and hasattr(packet, overload):
            found.append(getattr(packet, overload))
    return frozenset(found)


# The matmuls: aten.mm is every bias-free nn.Linear on a batch; addmm those with a bias (qwen2's q, k, v).
_MATMULS = _ops("aten.mm.default", "aten.addmm.default")
# torchtitan's save list less what fsdpjob never runs inside a block (tensor-parallel collectives, float8's
# amax, flex attention), plus the kernels fsdpjob's attention reaches that torchtitan's models do not: SDPA's
# CPU kernel (the tests) and torch's varlen attention (jobs/model/varlen.py).
_SAVE = _MATMULS | _ops(
    "aten._scaled_dot_product_efficient_attention.default",
    "aten._scaled_dot_product_flash_attention.default",
    "aten._scaled_dot_product_cudnn_attention.default",
    "aten._scaled_dot_product_attention_math.default",
    "aten._scaled_dot_product_fused_attention_overrideable.default",
    "aten._scaled_dot_product_flash_attention_for_cpu.default",
    "aten._flash_attention_forward.default",
    "torch_attn._varlen_attn.default",
)


def _op_policy() -> Callable:
    """A fresh policy per checkpointed forward: its matmul counts start at 0 for the forward and, apart, for the
    recompute, so both pick the same matmuls."""
    from torch.utils.checkpoint import CheckpointPolicy

    counts: Counter = Counter()

    def policy(ctx, func, *args, **kwargs):
        if func in _MATMULS:
            counts[ctx.is_recompute] += 1
            if counts[ctx.is_recompute] % 2 == 0:  # every second matmul is recomputed (torchtitan's choice)
                return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if func in _SAVE else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def _op_context():
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(_op_policy())


def wrap_blocks(layers: nn.ModuleList, ac: Checkpointing) -> int:
    """Wrap ``layers`` in place for ``ac``, before fully_shard (FSDP must see the wrapper as the block, so its
    hooks wrap the recomputation). Returns how many blocks were wrapped."""
    if not isinstance(ac, Checkpointing):  # a stale caller's bool would silently mean something else
        raise TypeError(f"activation checkpointing must be a Checkpointing, not {type(ac).__name__}")
    options = {"context_fn": _op_context} if ac.op_level else {}
    wrapped = 0
    for i, layer in enumerate(layers):
        if ac.checkpoints_block(i):
            layers[i] = checkpoint_wrapper(layer, checkpoint_impl=CheckpointImpl.NO_REENTRANT, **options)
            wrapped += 1
    return wrapped
