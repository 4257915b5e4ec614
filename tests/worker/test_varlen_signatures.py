"""jobs/model/varlen.py calls torch's varlen_attn by the signature the workers' torch has: 2.10's takes is_causal and
neither scale nor enable_gqa (passing scale= was a TypeError at the first forward of every packed bf16 GPU job);
2.12's takes scale, window_size and enable_gqa. Each fake below has the real release's signature and computes
what the flash kernel computes (causal attention per example, fewer KV heads taken natively), so the call and its
numbers are checked on CPU."""

from __future__ import annotations

import inspect
import math

import pytest
import torch

from fsdpjob.jobs.model import varlen

HEADS, KV_HEADS, DIM = 4, 2, 8


def _flash(q, k, v, cu, scale, causal):
    assert causal, "the kernel was not asked for causal attention"
    assert q.shape[1] % k.shape[1] == 0
    k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    return varlen._per_example(q, k, v, cu, scale)


def torch_2_10(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
    calls.append({"kv_heads": key.shape[1]})
    return _flash(query, key, value, cu_seq_q, 1 / math.sqrt(query.shape[-1]), is_causal)


def torch_2_12(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
               window_size=(-1, -1), enable_gqa=False):
    calls.append({"kv_heads": key.shape[1], "enable_gqa": enable_gqa, "scale": scale})
    if key.shape[1] != query.shape[1] and not enable_gqa:
        raise RuntimeError("different head counts without enable_gqa")
    return _flash(query, key, value, cu_seq_q, scale or 1 / math.sqrt(query.shape[-1]), window_size == (-1, 0))


calls: list[dict] = []


def _inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    tokens = 11
    q = torch.randn(tokens, HEADS, DIM, generator=g)
    k, v = (torch.randn(tokens, KV_HEADS, DIM, generator=g) for _ in range(2))
    return q, k, v, torch.tensor([0, 4, 9, 11], dtype=torch.int32)


@pytest.mark.parametrize("fake", [torch_2_10, torch_2_12], ids=["torch-2.10", "torch-2.12"])
@pytest.mark.parametrize("scale", [1 / math.sqrt(DIM), 0.2], ids=["default-scale", "own-scale"])
def test_the_kernel_is_called_by_the_signature_present(fake, scale):
    calls.clear()
    kernel = varlen.Kernel.of(fake)
    q, k, v, cu = _inputs()
    out = varlen._on_cuda(kernel, q, k, v, cu, 5, scale)
    want = varlen._per_example(q, k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1), cu, scale)
    torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)
    # k and v go in with their own head count: natively on 2.10, through enable_gqa on 2.12
    assert calls[-1]["kv_heads"] == KV_HEADS
    if fake is torch_2_12:
        assert calls[-1]["enable_gqa"] is True and calls[-1]["scale"] == scale


def test_the_signatures_are_read_as_the_releases_spell_them():
    old, new = varlen.Kernel.of(torch_2_10), varlen.Kernel.of(torch_2_12)
    assert (old.causal, old.takes_scale, old.takes_gqa) == ({"is_causal": True}, False, False)
    assert (new.causal, new.takes_scale, new.takes_gqa) == ({"window_size": (-1, 0)}, True, True)
    installed = varlen._varlen_kernel()
    if installed is not None:  # this machine's torch: whichever it has, it is read, not assumed
        assert installed.takes_scale == ("scale" in inspect.signature(installed.fn).parameters)
