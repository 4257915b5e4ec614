"""The chunked cross-entropy (spec train.loss: chunked): the summed token loss of a micro-batch without ever
holding the whole micro-batch's logits, only one chunk of tokens' at a time.

The backbone runs to the final hidden states [tokens, hidden]; each chunk of ``chunk_tokens`` tokens then goes
through lm_head and the cross-entropy (summed, in fp32) under torch.utils.checkpoint, so the forward keeps no
logits at all (a checkpointed chunk saves its inputs: a view of the hidden states and the targets) and the backward
recomputes one chunk's logits, takes their gradient and frees them before the next chunk's. The peak holds one
chunk's logits (in the compute dtype, in fp32 and their gradient) where the standard loss holds the micro-batch's:
at a 128K vocabulary and 16K tokens per micro-batch, 8 GiB for each fp32 copy against 0.5 GiB at 1,024 tokens.
One backward call per micro-batch, as in the standard path: FSDP2 reduce-scatters the root's gradients in the
callback at the end of each backward, so a backward per chunk would reduce-scatter (and reshard) once per chunk.

Why it runs inside the root module's forward (FSDP2): the root's parameters (the embedding, the final norm and
lm_head, which tied embeddings make one parameter) are all-gathered by the root's forward pre-hook and the root's
pre-backward hook is registered on the tensors its forward returns. Called from inside that forward, lm_head sees
its gathered weight, and the loss is the root's output, so the root's pre-backward hook fires on the loss's
gradient (gathering again first where the root was resharded after the forward) before any chunk is recomputed.
lm_head itself is called once, as a module, with its forward replaced by the chunk loop, so that if it becomes an
FSDP unit of its own (fsdp.separate_root, built separately: not tested with this yet) its hooks gather it once for
the loop and, in the backward, its pre-backward hook (on the returned loss) gathers it again before the chunks'
recomputation, which calls the class's forward directly (no FSDP hooks inside the backward). The chunk function
reads the weight through the module at call time (never a tensor captured in the forward), so the recomputation
uses whatever FSDP2 has gathered then; nothing here touches FSDP2's internals or calls unshard() by hand. Called
after the root's forward instead, lm_head would work only while the root stays gathered (reshard_after_forward
False, today's root) and its loss would not be an output FSDP2 hooks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from fsdpjob.orchestrator.core.savers import LOSS_CHUNK_TOKENS

CHUNK_TOKENS = LOSS_CHUNK_TOKENS  # core/savers.py's, which the planner reads too

@contextmanager
def _forward_replaced(module: nn.Module, forward: Callable) -> Iterator[None]:
    """``module``'s forward replaced for one call: nn.Module.__call__ still runs every hook (FSDP2's) around the
    instance attribute, which shadows the class's forward. Whatever instance forward there was comes back."""
    previous = module.__dict__.get("forward")
    module.forward = forward
    try:
        yield
    finally:
        if previous is None:
            del module.forward
        else:
            module.forward = previous


def _chunk_loss(head_forward: Callable, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = head_forward(hidden)
    return F.cross_entropy(logits.float(), targets, ignore_index=-100, reduction="sum")


def _chunks_loss(head_forward: Callable, hidden: torch.Tensor, targets: torch.Tensor,
                 chunk_tokens: int) -> torch.Tensor:
    """Summed token loss over ``hidden`` [tokens, hidden] and ``targets`` [tokens], one chunk at a time."""
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    recompute = torch.is_grad_enabled()  # evaluation (no_grad) keeps nothing for a backward anyway
    for h, t in zip(hidden.split(chunk_tokens), targets.split(chunk_tokens), strict=True):
        if recompute:
            total = total + checkpoint(_chunk_loss, head_forward, h, t, use_reentrant=False)
        else:
            total = total + _chunk_loss(head_forward, h, t)
    return total


def chunked_loss_sum(model: nn.Module, input_ids: torch.Tensor, targets: torch.Tensor, *,
                     position_ids: torch.Tensor | None = None, chunk_tokens: int = CHUNK_TOKENS,
                     **model_kwargs: Any) -> torch.Tensor:
    """The summed cross-entropy of ``targets`` (-100: ignored) over ``input_ids``' tokens, in fp32, computed in
    chunks of ``chunk_tokens`` tokens inside the root module's forward (see the module docstring for why).
    ``targets`` has one entry per token of ``input_ids`` in the same order (a flattened row or rows); the other
    keywords go to the backbone as they would go through the causal LM's forward (varlen boundaries)."""
    head = model.get_output_embeddings()
    head_forward = type(head).forward.__get__(head)  # the class's forward: the chunk loop replaces the instance's

    def head_loss(hidden: torch.Tensor, flat_targets: torch.Tensor) -> torch.Tensor:
        return _chunks_loss(head_forward, hidden, flat_targets, chunk_tokens)

    def root_forward(input_ids: torch.Tensor, targets: torch.Tensor, position_ids: torch.Tensor | None = None,
                     **kwargs: Any) -> torch.Tensor:
        hidden = model.base_model(input_ids=input_ids, position_ids=position_ids, use_cache=False,
                                  **kwargs).last_hidden_state
        with _forward_replaced(head, head_loss):
            return head(hidden.reshape(-1, hidden.size(-1)), targets.reshape(-1))

    with _forward_replaced(model, root_forward):
        return model(input_ids=input_ids, targets=targets, position_ids=position_ids, **model_kwargs)
