"""Seeded token sampling and one-completion generation, bitwise reproducible from (weights, prompt, seed, index).

Every completion draws from its own CPU ``torch.Generator`` seeded from (request seed, completion index), and its
logits are sampled in float32 on the CPU: the draws never depend on the device, on what else is generated at the
same time, or on how many completions came before. Greedy (temperature 0) takes the first maximal logit.

The generation server (server.py) uses ``generate_one``; the in-process generator can reuse ``choice_seed`` and
``next_token`` so both backends sample the same way.
"""

from __future__ import annotations

import hashlib
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch


def eos_ids(*sources: object) -> frozenset[int]:
    """The ids that end a completion: every source's eos_token_id (one id or a list; a tokenizer, a model config,
    a generation config, whose list names a chat model's end-of-turn token; None is skipped). The in-process
    generation and the server stop on the same ids."""
    ids: set[int] = set()
    for source in sources:
        value = getattr(source, "eos_token_id", None)
        ids.update([value] if isinstance(value, int) else list(value or []))
    return frozenset(ids)


def choice_seed(seed: int, index: int) -> int:
    """The generator seed of completion ``index`` of a request seeded ``seed``: a hash of both, so that
    (seed, index) pairs never collide the way ``seed + index`` would ((1, 0) and (0, 1))."""
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def choice_generator(seed: int, index: int) -> torch.Generator:
    return torch.Generator(device="cpu").manual_seed(choice_seed(seed, index))


def next_token(logits: torch.Tensor, *, temperature: float, top_p: float, generator: torch.Generator) -> int:
    """One token id from a 1-D vector of next-token logits. Nucleus (top_p) keeps the most probable tokens whose
    cumulative probability reaches ``top_p`` (at least one); ties sort stably, so the kept set is reproducible."""
    logits = logits.detach().to(device="cpu", dtype=torch.float32)
    if temperature == 0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True, stable=True)
        before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # mass of the tokens ranked above each one
        sorted_probs = torch.where(before < top_p, sorted_probs, torch.zeros_like(sorted_probs))
        pick = int(torch.multinomial(sorted_probs, 1, generator=generator))
        return int(order[pick])
    return int(torch.multinomial(probs, 1, generator=generator))


def cache_keyword(model: torch.nn.Module) -> str:
    """The forward's name for the KV cache: ``cache`` from transformers 5.x, ``past_key_values`` before (5.x still
    takes the old name, with a deprecation warning, until its removal)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


@dataclass(frozen=True)
class Completion:
    token_ids: list[int]  # generated ids, the eos that ended it included
    finish_reason: str  # "stop" (eos or a stop string) or "length" (max_tokens)


@torch.inference_mode()
def generate_one(
    model: torch.nn.Module,
    prompt_ids: Sequence[int],
    *,
    max_tokens: int,
    temperature: float,
    top_p: float,
    generator: torch.Generator,
    eos_ids: frozenset[int],
    stopped: Callable[[list[int]], bool] | None = None,
) -> Completion:
    """Generate one completion alone (batch of one, no padding) with the model's KV cache: its result depends only
    on the weights, the prompt and the generator. ``stopped`` sees the ids so far after each token (stop strings)."""
    device = next(model.parameters()).device
    inputs = torch.tensor([list(prompt_ids)], dtype=torch.long, device=device)
    keyword = cache_keyword(model)
    cache = None
    out: list[int] = []
    for _ in range(max_tokens):
        result = model(input_ids=inputs, use_cache=True, **{keyword: cache})
        cache = getattr(result, keyword)
        token = next_token(result.logits[0, -1], temperature=temperature, top_p=top_p, generator=generator)
        out.append(token)
        if token in eos_ids or (stopped is not None and stopped(out)):
            return Completion(out, "stop")
        inputs = torch.tensor([[token]], dtype=torch.long, device=device)
    return Completion(out, "length")
