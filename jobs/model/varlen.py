"""Varlen attention for boundary-aware packing: each packed example attends to itself only, with no mask.

transformers' sdpa path reads packed examples from ``position_ids`` and builds a dense [B, 1, S, S] mask: no flash
kernel, the full S^2 work, and memory the plan must count. Its flash_attention_2 path needs the flash-attn package
and, given only ``position_ids``, recomputes the sequence boundaries in every layer (two host syncs each, again in
the activation-checkpointing recompute). Here the boundaries are computed once per micro-batch on the host
(``seq_lens``, from the positions, which restart at 0 at each example and at the padding tail) and passed to the
model as the varlen kwargs transformers forwards to every attention call (``cu_seq_lens_q/k``, ``max_length_q/k``,
as its ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)`` does). The attention registered under
:data:`NAME` runs torch's own flash-based ``varlen_attn`` on CUDA (no package to install); on other devices it runs
SDPA per example (exact, slower: tests and CPU runs).
"""

from __future__ import annotations

import inspect
import math
from functools import cache
from typing import NamedTuple

import torch
import torch.nn.functional as F

NAME = "fsdpjob_varlen"  # the name the model is built with (transformers' AttentionInterface)


class SeqLens(NamedTuple):
    """Where the examples of a flattened micro-batch start and end (int32, [examples + 1]) and an upper bound of
    their length: the row length, a constant, so compiled blocks see one value and never recompile for it."""

    cu_seq_lens: torch.Tensor
    max_length: int


def seq_lens(position_ids: torch.Tensor) -> SeqLens:
    """The boundaries of a packed micro-batch's rows flattened into one: an example starts wherever its position
    is 0 (each row starts at 0 too, so rows stay apart; the padding tail is a block of its own). Host tensors in,
    host tensors out: no device sync."""
    flat = position_ids.reshape(-1)
    starts = torch.nonzero(flat == 0).flatten()
    cu = torch.cat([starts, torch.tensor([flat.numel()])]).to(torch.int32)
    return SeqLens(cu, int(position_ids.shape[-1]))


def model_kwargs(lens: SeqLens, device: torch.device) -> dict:
    """The kwargs transformers hands to each attention call (its FlashAttentionKwargs names)."""
    cu = lens.cu_seq_lens
    if device.type == "cuda":
        cu = cu.pin_memory().to(device, non_blocking=True)  # queued before the forward that reads it: no sync
    return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": lens.max_length, "max_length_k": lens.max_length}


class Kernel(NamedTuple):
    """torch's ``varlen_attn`` and what this torch's signature takes: it changed between releases (2.10 has
    ``is_causal`` and no ``scale``, ``window_size`` or ``enable_gqa``; 2.12 has all three and no ``is_causal``)."""

    fn: object
    causal: dict
    takes_scale: bool
    takes_gqa: bool

    @classmethod
    def of(cls, fn) -> Kernel:
        params = inspect.signature(fn).parameters
        causal = {"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)}
        return cls(fn, causal, "scale" in params, "enable_gqa" in params)


@cache
def _varlen_kernel() -> Kernel | None:
    """torch's varlen flash attention (torch >= 2.10, CUDA), read for its signature, or None."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return Kernel.of(varlen_attn)


def cuda_kernel_available() -> bool:
    return _varlen_kernel() is not None and torch.cuda.is_available()


def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention-function signature: q/k/v [1, heads, tokens, head_dim] (the micro-batch's rows
    flattened into one), output [1, tokens, heads, head_dim]."""
    if dropout:
        raise ValueError(f"{NAME} has no attention dropout; set the model's attention_dropout to 0")
    for unsupported in ("sliding_window", "softcap", "s_aux"):
        if kwargs.get(unsupported) is not None:
            raise ValueError(f"{NAME} does not implement {unsupported}; set model.attn_implementation: sdpa")
    cu = kwargs.get("cu_seq_lens_q")
    if cu is None or query.shape[0] != 1:
        raise ValueError(f"{NAME} needs the packed micro-batch flattened with its cu_seq_lens (jobs/step.py)")
    scale = scaling if scaling is not None else 1 / math.sqrt(query.shape[-1])
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [tokens, heads, head_dim]
    kernel = _varlen_kernel()
    if kernel is not None and q.is_cuda:
        out = _on_cuda(kernel, q, k, v, cu, kwargs["max_length_q"], scale)
    else:
        out = _per_example(q, k, v, cu, scale)
    return out.unsqueeze(0), None


def _on_cuda(kernel: Kernel, q, k, v, cu, max_length: int, scale: float) -> torch.Tensor:
    """Called by the signature present. Without ``scale`` the kernel uses 1/sqrt(head_dim) (Llama's own scaling):
    another scale is folded into q. Without ``enable_gqa`` k and v go in un-repeated, as the flash kernel takes
    fewer KV heads natively (repeating them would copy k and v in every layer and every recompute)."""
    extra = dict(kernel.causal)
    default = 1 / math.sqrt(q.shape[-1])
    if kernel.takes_scale:
        extra["scale"] = scale
    elif not math.isclose(scale, default, rel_tol=1e-6):
        q = q * (scale / default)
    if kernel.takes_gqa and k.shape[1] != q.shape[1]:
        extra["enable_gqa"] = True
    return kernel.fn(q, k, v, cu, cu, max_length, max_length, **extra)


def _per_example(q, k, v, cu, scale: float) -> torch.Tensor:
    """Causal SDPA on each example alone (heads first, as SDPA wants them)."""
    out = torch.empty_like(q)
    gqa = k.shape[1] != q.shape[1]
    bounds = cu.tolist()
    for a, b in zip(bounds[:-1], bounds[1:]):
        if b > a:
            part = F.scaled_dot_product_attention(q[a:b].transpose(0, 1), k[a:b].transpose(0, 1),
                                                  v[a:b].transpose(0, 1), is_causal=True, scale=scale, enable_gqa=gqa)
            out[a:b] = part.transpose(0, 1)
    return out


def register() -> None:
    """Make :data:`NAME` a transformers attention implementation (idempotent). No mask function is registered on
    purpose: transformers then builds no mask at all for it."""
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, attention)
