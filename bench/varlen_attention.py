"""Packed-batch attention on one GPU: fsdpjob's varlen path against transformers' dense-mask sdpa path.

    python bench/varlen_attention.py            # CUDA, bf16: a 8192-token micro-batch of long-tailed examples
    python bench/varlen_attention.py --tiny     # CPU, small shapes (checks the script itself; CI)

Two parts, one JSON line each and a table:
1. correctness: a small random Llama in bf16 (fp32 on CPU) with ``model.attn_implementation`` varlen: the packed
   rows' logits against each example's alone (sdpa), the largest relative error;
2. speed, attention alone (forward + backward, Llama-3-8B heads: 32 query, 8 kv, head_dim 128): the varlen kernel
   with the boundaries as cu_seq_lens; SDPA with the [1, 1, S, S] block-diagonal bool mask transformers builds for
   packed rows under sdpa; SDPA causal over the whole row (no mask: wrong across examples, the lower bound of a
   dense kernel). Each timed over --iters calls after --warmup, CUDA-synchronised; ratios against the mask path.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time

import torch
import torch.nn.functional as F


def lengths(total: int, seed: int = 0) -> list[int]:
    """Example lengths drawn from a long tail (log-normal, as chat SFT sets are), filling ``total`` tokens."""
    rng = random.Random(seed)
    out: list[int] = []
    while (left := total - sum(out)) > 0:
        out.append(min(left, max(8, int(rng.lognormvariate(math.log(400), 1.0)))))
    return out


def positions_for(lens: list[int]) -> torch.Tensor:
    return torch.cat([torch.arange(n) for n in lens])[None]


def correctness(device: torch.device, dtype: torch.dtype) -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM

    from fsdpjob.jobs.model import varlen
    from fsdpjob.jobs.step import forward_logits

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=4096)
    model = LlamaForCausalLM(cfg).to(device=device, dtype=dtype).eval()
    lens = lengths(1024, seed=1)
    ids = torch.randint(0, 1000, (1, sum(lens)))
    pos = positions_for(lens)
    varlen.register()
    model.set_attn_implementation(varlen.NAME)
    with torch.no_grad():
        packed = forward_logits(model, ids.to(device), pos, device).float()
        model.set_attn_implementation("sdpa")
        worst, at = 0.0, 0
        for n in lens:
            alone = model(input_ids=ids[:, at:at + n].to(device), use_cache=False).logits.float()
            part = packed[:, at:at + n]
            worst = max(worst, float((part - alone).abs().max() / alone.abs().max()))
            at += n
    kernel = "varlen_attn" if device.type == "cuda" and varlen.cuda_kernel_available() else "sdpa per example"
    return {"part": "correctness", "examples": len(lens), "tokens": sum(lens), "max_rel_error": worst,
            "kernel": kernel, "dtype": str(dtype).removeprefix("torch.")}


def _time(fn, iters: int, warmup: int, device: torch.device) -> float:
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters * 1e3


def speed(device: torch.device, dtype: torch.dtype, tokens: int, heads: int, kv_heads: int, head_dim: int,
          iters: int, warmup: int) -> dict:
    from fsdpjob.jobs.model import varlen

    lens = lengths(tokens, seed=2)
    lens_meta = varlen.seq_lens(positions_for(lens))
    kw = varlen.model_kwargs(lens_meta, device)
    gen = torch.Generator(device="cpu").manual_seed(0)

    def qkv():
        make = lambda h: torch.randn(1, h, tokens, head_dim, generator=gen).to(device, dtype).requires_grad_()  # noqa: E731
        return make(heads), make(kv_heads), make(kv_heads)

    q, k, v = qkv()
    doc = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens)).to(device)
    causal = torch.ones(tokens, tokens, dtype=torch.bool, device=device).tril()
    mask = (causal & (doc[:, None] == doc[None, :]))[None, None]  # what transformers' sdpa_mask builds for packing

    def run_varlen():
        out, _ = varlen.attention(None, q, k, v, None, scaling=None, **kw)
        out.sum().backward()

    def run_mask():
        F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True).sum().backward()

    def run_causal():
        F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).sum().backward()

    ms = {name: _time(fn, iters, warmup, device)
          for name, fn in (("varlen", run_varlen), ("sdpa_dense_mask", run_mask), ("sdpa_causal_no_mask", run_causal))}
    return {"part": "speed", "tokens": tokens, "examples": len(lens), "heads": heads, "kv_heads": kv_heads,
            "head_dim": head_dim, "ms_fwd_bwd": ms, "mask_bytes": mask.numel(),
            "varlen_speedup_over_dense_mask": ms["sdpa_dense_mask"] / ms["varlen"],
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="CPU, small shapes")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    args = parser.parse_args()
    if args.tiny or not torch.cuda.is_available():
        device, dtype, shape = torch.device("cpu"), torch.float32, (512, 4, 2, 32)
        args.iters, args.warmup = min(args.iters, 3), 1
    else:
        device, dtype, shape = torch.device("cuda", 0), torch.bfloat16, (8192, 32, 8, 128)
    rows = [correctness(device, dtype), speed(device, dtype, *shape, args.iters, args.warmup)]
    for row in rows:
        print(json.dumps(row))
    ms = rows[1]["ms_fwd_bwd"]
    print(f"\ncorrectness: max relative error {rows[0]['max_rel_error']:.2e} over {rows[0]['examples']} examples "
          f"({rows[0]['kernel']}, {rows[0]['dtype']})")
    print(f"attention fwd+bwd, {rows[1]['tokens']} tokens in {rows[1]['examples']} examples on {rows[1]['device']}:")
    for name, value in ms.items():
        print(f"  {name:22} {value:9.2f} ms   {ms['sdpa_dense_mask'] / value:5.2f}x of the dense-mask path")
    sys.exit(0 if rows[0]["max_rel_error"] < (2e-2 if dtype == torch.bfloat16 else 1e-4) else 1)


if __name__ == "__main__":
    main()
