"""In-process generation (jobs/grpo/generate.py) on 2 gloo ranks with the FSDP2-sharded tiny model.

One 2-rank run generates for uneven prompt counts and lengths (and a rank with no prompt at all), counts every
rank's forwards, and scores the completions with completion_logps; this process then checks the results against
the same model unsharded: our generate on it (bitwise), transformers' own generate with the global RNG seeded as
the rank's generator (bitwise tokens: the independent check of the sampling, padding and position semantics),
and a plain forward's log-softmax per row without padding (fp32 tolerance: the matmul shapes differ).
"""

from __future__ import annotations

import pytest
import torch
from distributed import run_ranks
from test_model import TINY, _load, save_tiny
from torch import nn
from torch.testing import assert_close

from fsdpjob.jobs.grpo.generate import (
    STOP_CHECK_EVERY,
    completion_logps,
    completions_of,
    generate,
    left_pad,
    sample_next,
    top_p_filter,
)
from fsdpjob.jobs.model.checkpointing import FULL

pytestmark = pytest.mark.distributed

CPU = torch.device("cpu")
PAD = 0
EOS = set(range(200, 236))  # 36 of 256 tokens: most completions end within a dozen tokens, some do not
SAMPLING = dict(max_new_tokens=12, temperature=0.9, top_p=0.8)
PROMPTS = {0: [[5, 6, 7, 8, 9], [11, 12], [3, 1, 4, 1, 5, 9, 2, 6, 5]], 1: [[40, 41, 42, 43]]}
SEEDS = {0: 100, 1: 101}


def _prompts(rank: int) -> list[list[int]]:
    return PROMPTS[rank]


class _Counting(nn.Module):
    """Counts the root forwards of the wrapped model (the all-gathers every rank must match)."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner, self.config, self.calls = inner, inner.config, 0

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, use_cache=None,
                logits_to_keep=0):
        self.calls += 1
        return self.inner(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, cache=cache,
                          use_cache=use_cache, logits_to_keep=logits_to_keep)


def _generate(model, prompts, seed, **overrides):
    options = {"eos_token_ids": EOS, **SAMPLING, **overrides}
    return generate(model, prompts, generator=torch.Generator().manual_seed(seed), pad_id=PAD, device=CPU, **options)


def _portable(value):
    """Tensors as (lists, shape, dtype): a spawned rank's tensors would travel by a shared-memory handle that
    dies with the process."""
    if isinstance(value, torch.Tensor):
        return ("tensor", value.tolist(), tuple(value.shape), str(value.dtype).removeprefix("torch."))
    if isinstance(value, tuple):
        return type(value)(*map(_portable, value))
    return value


def _restored(value):
    if isinstance(value, tuple) and value and value[0] == "tensor":
        _, data, shape, dtype = value
        return torch.tensor(data, dtype=getattr(torch, dtype)).reshape(shape)
    if isinstance(value, tuple):
        return type(value)(*map(_restored, value))
    return value


def _ranks(rank: int, world_size: int, path) -> dict:
    from fsdpjob.jobs.dist import close_distributed, init_distributed

    env = init_distributed(60)
    model = _Counting(_load(path, env))
    model.train()
    out = _generate(model, _prompts(rank), SEEDS[rank])
    calls, training_after = model.calls, model.training
    again = _generate(model, _prompts(rank), SEEDS[rank])
    # Early stop: every completion ends at once (EOS = the whole vocabulary), both ranks stop at the first check.
    model.calls = 0
    short = _generate(model, _prompts(rank), SEEDS[rank], max_new_tokens=3 * STOP_CHECK_EVERY,
                      eos_token_ids=set(range(TINY["vocab_size"])))
    early_calls = model.calls
    # A rank without prompts still runs the forwards of the one with some.
    model.calls = 0
    empty = _generate(model, _prompts(0)[:2] if rank == 0 else [], SEEDS[rank])
    empty_calls = model.calls
    logps = completion_logps(model, _prompts(rank), out.completion_ids, out.mask, CPU,
                             temperature=SAMPLING["temperature"])
    # Activation checkpointing and the root kept gathered change nothing in generation.
    checkpointed = _generate(_load(path, env, activation_checkpointing=FULL, reshard_after_forward=False),
                             _prompts(rank), SEEDS[rank])
    close_distributed()
    result = {"out": out, "again": again, "calls": calls, "training_after": training_after, "early": early_calls,
              "short": short, "empty": empty, "empty_calls": empty_calls, "logps": logps.detach(),
              "checkpointed": checkpointed}
    return {k: _portable(v) for k, v in result.items()}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("grpo_gen") / "m")


@pytest.fixture(scope="module")
def sharded(tiny) -> list[dict]:
    return [{k: _restored(v) for k, v in r.items()} for r in run_ranks(_ranks, 2, timeout=300, path=tiny)]


@pytest.fixture(scope="module")
def plain(tiny) -> nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32, attn_implementation="sdpa").eval()


def test_ranks_run_in_lockstep_whatever_their_prompts(sharded):
    for rank, result in enumerate(sharded):
        assert result["calls"] == SAMPLING["max_new_tokens"], rank  # exactly max_new_tokens forwards
        assert result["empty_calls"] == SAMPLING["max_new_tokens"], rank
        assert result["early"] == STOP_CHECK_EVERY, rank  # all ended: both ranks stop at the first check
        assert result["training_after"] is True  # the model's mode is given back
    assert sharded[1]["empty"].completion_ids.shape == (0, SAMPLING["max_new_tokens"])
    assert sharded[0]["empty"].completion_ids.shape == (2, SAMPLING["max_new_tokens"])


def test_the_sharded_completions_are_bitwise_the_unsharded_ones_and_deterministic(sharded, plain):
    for rank, result in enumerate(sharded):
        alone = _generate(plain, _prompts(rank), SEEDS[rank])
        for field in alone._fields:
            assert torch.equal(getattr(result["out"], field), getattr(alone, field)), (rank, field)
            assert torch.equal(getattr(result["again"], field), getattr(alone, field)), (rank, field)
            assert torch.equal(getattr(result["checkpointed"], field), getattr(alone, field)), (rank, field)
    rank0 = sharded[0]["out"]
    assert rank0.truncated.any() and not rank0.truncated.all(), "the case should have ended and truncated rows"
    other = _generate(plain, _prompts(0), SEEDS[0] + 7)
    assert not torch.equal(other.completion_ids, rank0.completion_ids)


def test_the_completions_are_transformers_generate_with_the_same_seed(sharded, plain):
    """HF's sampler draws from the global generator: seeded like the rank's, it draws the same tokens."""
    for rank, result in enumerate(sharded):
        ids, mask = left_pad(_prompts(rank), PAD, CPU)
        torch.manual_seed(SEEDS[rank])
        with torch.no_grad():
            full = plain.generate(input_ids=ids, attention_mask=mask, do_sample=True, top_k=0,
                                  eos_token_id=sorted(EOS), pad_token_id=PAD, **SAMPLING)
        theirs = full[:, ids.shape[1]:]
        width = SAMPLING["max_new_tokens"]
        theirs = torch.cat([theirs, theirs.new_full((len(theirs), width - theirs.shape[1]), PAD)], dim=1)
        assert torch.equal(result["out"].completion_ids, theirs), rank


def test_eos_ends_each_completion_and_pads_after_it(sharded):
    for result in sharded:
        out = result["out"]
        eos = torch.tensor(sorted(EOS))
        for ids, length, mask, truncated in zip(*out, strict=True):
            n = int(length)
            assert mask.tolist() == [1] * n + [0] * (len(ids) - n)
            assert not torch.isin(ids[: n - 1], eos).any()
            assert bool(truncated) == (not bool(torch.isin(ids[n - 1], eos)))
            assert (ids[n:] == PAD).all()
    short = sharded[0]["short"]
    assert short.lengths.tolist() == [1, 1, 1] and not short.truncated.any()


def test_completion_logps_are_a_plain_forwards_log_softmax_without_padding(sharded, plain):
    temperature = SAMPLING["temperature"]
    for rank, result in enumerate(sharded):
        out = result["out"]
        for i, prompt in enumerate(_prompts(rank)):
            n = int(out.lengths[i])
            ids = torch.tensor([prompt + out.completion_ids[i, :n].tolist()])
            with torch.no_grad():
                logits = plain(input_ids=ids).logits[0, len(prompt) - 1 : -1] / temperature
            expected = logits.log_softmax(-1).gather(-1, ids[0, len(prompt):, None]).squeeze(-1)
            assert_close(result["logps"][i, :n], expected, rtol=1e-5, atol=1e-5)
            assert (result["logps"][i, n:] == 0).all()


class _Recording(_Counting):
    """Keeps the last position's logits of every forward."""

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, use_cache=None,
                logits_to_keep=0):
        out = super().forward(input_ids, attention_mask, position_ids, cache, use_cache, logits_to_keep)
        self.logits = [*getattr(self, "logits", []), out.logits[:, -1].detach().clone()]
        return out


def test_generation_logits_are_the_full_forward_ones_and_do_not_depend_on_padding(plain):
    """The KV-cached, left-padded decode gives each token the log-prob a full forward gives it (completion_logps)
    and a single unpadded row gives it, to fp32 tolerance; gradients flow through completion_logps."""
    prompts = PROMPTS[0]
    model = _Recording(plain)
    out = generate(model, prompts, generator=torch.Generator().manual_seed(3), eos_token_ids=EOS, pad_id=PAD,
                   device=CPU, max_new_tokens=8, temperature=1.0, top_p=1.0)
    decoded = torch.stack(model.logits, dim=1).log_softmax(-1)  # [N, T, V]
    picked = decoded.gather(-1, out.completion_ids.unsqueeze(-1)).squeeze(-1) * out.mask
    batch = completion_logps(plain, prompts, out.completion_ids, out.mask, CPU, temperature=1.0)
    assert_close(picked, batch, rtol=1e-5, atol=1e-5)
    for i, prompt in enumerate(prompts):
        row = completion_logps(plain, [prompt], out.completion_ids[i : i + 1], out.mask[i : i + 1], CPU,
                               temperature=1.0)
        assert_close(row[0], batch[i], rtol=1e-5, atol=1e-5)
    plain.zero_grad()
    completion_logps(plain, prompts, out.completion_ids, out.mask, CPU, temperature=1.0).sum().backward()
    assert plain.lm_head.weight.grad is not None and plain.lm_head.weight.grad.abs().sum() > 0
    plain.zero_grad()


def test_top_p_is_transformers_warper_and_sampling_follows_the_generator():
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopPLogitsWarper

    g = torch.Generator().manual_seed(0)
    scores = 3 * torch.randn(6, 50, generator=g)
    for top_p in (0.1, 0.5, 0.9, 0.999):
        assert torch.equal(top_p_filter(scores, top_p), TopPLogitsWarper(top_p)(None, scores))
    hf = TopPLogitsWarper(0.7)(None, TemperatureLogitsWarper(0.6)(None, scores))
    torch.manual_seed(5)
    expected = torch.multinomial(hf.softmax(-1), 1).squeeze(1)
    ours = sample_next(scores, temperature=0.6, top_p=0.7, generator=torch.Generator().manual_seed(5))
    assert torch.equal(ours, expected)


def test_completions_of_marks_the_first_eos():
    tokens = torch.tensor([[4, 9, 0, 0], [4, 4, 4, 4], [9, 0, 0, 0]])
    out = completions_of(tokens, torch.tensor([9]))
    assert out.lengths.tolist() == [2, 4, 1] and out.truncated.tolist() == [False, True, False]
    assert out.mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]]
