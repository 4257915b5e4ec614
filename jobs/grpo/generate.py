"""In-process generation with the FSDP2-sharded policy (grpo.generator.backend inprocess), and the completion
tokens' log-probabilities under a model (the policy, the old policy, the reference).

Lockstep: FSDP2 all-gathers each block's weights in every forward, so every rank must run the same forwards.
``generate`` runs exactly ``max_new_tokens`` forwards on every rank (the prompt's, then one per new token but the
last), whatever its completions' lengths and even with no prompt at all (a one-token stand-in row), and stops
earlier only when every completion on every rank has ended: one all-reduce of a flag every STOP_CHECK_EVERY
tokens (a 1-element collective, against the per-token all-gathers of every block). No rank gathers the whole
model: the forwards are FSDP2's own, block by block.

The layout is HF generate's: prompts left-padded, the attention mask 0 on the padding, position ids counted
from each row's first prompt token (so a row's logits do not depend on the other rows' lengths, up to the
rounding of differently shaped matmuls), a KV cache (transformers' DynamicCache). Sampling is HF's: the logits
in fp32 divided by the temperature, then TopPLogitsWarper's nucleus filter, softmax, one multinomial draw per
row per step from the caller's generator (the same generator state gives the same completions; finished rows
draw too, as in HF, so the draws do not depend on when rows finish). After a row's EOS its tokens are pad_id.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

STOP_CHECK_EVERY = 16  # tokens between the all-reduces that let every rank stop once all completions have ended


def eos_ids(*sources: object) -> frozenset[int]:
    """The ids that end a completion: every source's eos_token_id (one id or a list; a tokenizer, a model config,
    a generation config, whose list names a chat model's end-of-turn token; None is skipped)."""
    ids: set[int] = set()
    for source in sources:
        value = getattr(source, "eos_token_id", None)
        ids.update([value] if isinstance(value, int) else list(value or []))
    return frozenset(ids)


class Completions(NamedTuple):
    completion_ids: torch.Tensor  # [N, max_new_tokens] long; pad_id after the EOS token
    lengths: torch.Tensor  # [N] long: tokens up to and including EOS (max_new_tokens when truncated)
    mask: torch.Tensor  # [N, max_new_tokens] long: 1 on the completion's tokens, its EOS included
    truncated: torch.Tensor  # [N] bool: no EOS within max_new_tokens


def left_pad(rows: Sequence[Sequence[int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, longest] token ids left-padded with ``pad_id``, and the [N, longest] attention mask (0 on padding)."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        if len(row):
            ids[i, width - len(row):] = torch.as_tensor(row, dtype=torch.long)
            mask[i, width - len(row):] = 1
    return ids.to(device), mask.to(device)


def positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """HF generate's position ids: counted from each row's first attended token, 0 on the left padding."""
    return (attention_mask.long().cumsum(-1) - 1).masked_fill(attention_mask == 0, 0)


def top_p_filter(scores: torch.Tensor, top_p: float) -> torch.Tensor:
    """transformers' TopPLogitsWarper (min_tokens_to_keep 1): -inf on the tokens outside the smallest set whose
    probabilities add up to at least top_p, the most likely token always kept."""
    sorted_scores, order = torch.sort(scores, descending=False)
    cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
    remove_sorted = cumulative <= (1 - top_p)
    remove_sorted[..., -1:] = False
    remove = remove_sorted.scatter(1, order, remove_sorted)
    return scores.masked_fill(remove, -float("inf"))


def sample_next(logits: torch.Tensor, *, temperature: float, top_p: float,
                generator: torch.Generator) -> torch.Tensor:
    """[N] tokens drawn from [N, V] logits: fp32, / temperature, then top_p (HF's order), one multinomial draw
    per row from ``generator`` (on the logits' device)."""
    scores = logits.float()
    if temperature != 1.0:
        scores = scores / temperature
    if top_p < 1.0:
        scores = top_p_filter(scores, top_p)
    return torch.multinomial(scores.softmax(dim=-1), num_samples=1, generator=generator).squeeze(1)


def _cache_argument(model: nn.Module) -> str:
    """The forward's name for the KV cache: ``cache`` since transformers 5.25, ``past_key_values`` before."""
    return "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"


def _new_cache(model: nn.Module):
    from transformers import DynamicCache

    try:
        return DynamicCache(config=model.config)  # per-layer kinds (sliding windows) from the config
    except TypeError:  # transformers before the config argument
        return DynamicCache()


def _all_ended(ended: torch.Tensor, device: torch.device) -> bool:
    """True when every row has ended on every rank (MIN of this rank's flag over the world)."""
    flag = torch.tensor([int(bool(ended.all()))], dtype=torch.int32, device=device)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def _decode(model: nn.Module, ids: torch.Tensor, attention: torch.Tensor, rows: int, *, max_new_tokens: int,
            sample, eos: torch.Tensor, pad_id: int, device: torch.device) -> torch.Tensor:
    """[rows, max_new_tokens] tokens (pad_id after EOS), from exactly the forwards every rank runs."""
    cache, cache_arg = _new_cache(model), _cache_argument(model)
    out = torch.full((rows, max_new_tokens), pad_id, dtype=torch.long, device=device)
    ended = torch.zeros(rows, dtype=torch.bool, device=device)
    pos = positions(attention)
    step_ids = ids
    for t in range(max_new_tokens):
        logits = model(input_ids=step_ids, attention_mask=attention, position_ids=pos, use_cache=True,
                       logits_to_keep=1, **{cache_arg: cache}).logits[:, -1]
        if rows:
            token = torch.where(ended, pad_id, sample(logits[:rows]))
            out[:, t] = token
            ended |= torch.isin(token, eos)
        if t + 1 == max_new_tokens:
            break
        if (t + 1) % STOP_CHECK_EVERY == 0 and _all_ended(ended, device):
            break
        # The next forward: the token just drawn (the stand-in row of an empty rank feeds pad_id).
        step_ids = out[:, t : t + 1] if rows else torch.full((1, 1), pad_id, dtype=torch.long, device=device)
        attention = torch.cat([attention, attention.new_ones((len(attention), 1))], dim=1)
        pos = pos[:, -1:] + 1
    return out


def generate(model: nn.Module, prompt_ids: Sequence[Sequence[int]], *, max_new_tokens: int, temperature: float,
             top_p: float, generator: torch.Generator, eos_token_ids: set[int], pad_id: int,
             device: torch.device) -> Completions:
    """Sample one completion of up to ``max_new_tokens`` tokens for each prompt (token ids, unpadded; a rank may
    have none), in lockstep with the other ranks (see the module's docstring); no grad, the model in eval mode
    for the generation and back to its mode after."""
    rows = len(prompt_ids)
    if any(len(p) == 0 for p in prompt_ids):
        raise ValueError("an empty prompt: every prompt needs at least one token")
    ids, attention = left_pad(list(prompt_ids) or [[pad_id]], pad_id, device)
    eos = torch.tensor(sorted(eos_token_ids), dtype=torch.long, device=device)

    def sample(logits: torch.Tensor) -> torch.Tensor:
        return sample_next(logits, temperature=temperature, top_p=top_p, generator=generator)

    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            tokens = _decode(model, ids, attention, rows, max_new_tokens=max_new_tokens, sample=sample, eos=eos,
                             pad_id=pad_id, device=device)
    finally:
        model.train(was_training)
    return completions_of(tokens, eos)


def completions_of(tokens: torch.Tensor, eos: torch.Tensor) -> Completions:
    """Lengths, mask and truncation of [N, T] completion tokens: each ends at its first token in ``eos``."""
    is_eos = torch.isin(tokens, eos)
    width = tokens.shape[1]
    truncated = ~is_eos.any(dim=1)
    lengths = torch.where(truncated, width, is_eos.int().argmax(dim=1) + 1)
    mask = (torch.arange(width, device=tokens.device)[None, :] < lengths[:, None]).long()
    return Completions(tokens, lengths, mask, truncated)


def completion_logps(model: nn.Module, prompt_ids: Sequence[Sequence[int]], completion_ids: torch.Tensor,
                     mask: torch.Tensor, device: torch.device, *, temperature: float,
                     entropy: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """[N, T] log-probability of each completion token under ``model``, its logits divided by ``temperature``
    (TRL's, so that the ratio is taken against the distribution sampled from); 0 outside ``mask``.

    The training forward (with grad when enabled; the model's mode is the caller's), on generate's layout:
    prompts left-padded, the completion after them, the attention mask 0 on the padding and after each EOS
    (TRL's), position ids from each row's first token. The prompt padding's id is irrelevant (never attended).
    """
    prompts, prompt_mask = left_pad(prompt_ids, 0, device)
    completion_ids, mask = completion_ids.to(device), mask.to(device)
    width = completion_ids.shape[1]
    attention = torch.cat([prompt_mask, mask.long()], dim=1)
    logits = model(input_ids=torch.cat([prompts, completion_ids], dim=1), attention_mask=attention,
                   position_ids=positions(attention), use_cache=False, logits_to_keep=width + 1).logits
    # Position j predicts completion token j. Only the completion's positions are upcast and scored (as
    # jobs/preference/losses.py answer_logps): an fp32 [N, T, V] copy is what a large vocabulary cannot afford.
    rows, cols = (mask != 0).nonzero(as_tuple=True)
    scores = logits[:, :-1][rows, cols].float() / temperature
    picked = -F.cross_entropy(scores, completion_ids[rows, cols], reduction="none")
    logps = scores.new_zeros(completion_ids.shape).index_put((rows, cols), picked)
    if not entropy:
        return logps
    with torch.no_grad():  # with ``entropy``: each token's entropy of the same distribution too (TRL's metric)
        log_p = F.log_softmax(scores.detach(), dim=-1)
        per_token = -(log_p.exp() * log_p).sum(dim=-1)
    return logps, scores.new_zeros(completion_ids.shape).index_put((rows, cols), per_token)
