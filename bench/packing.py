"""Real (target) tokens per second and padding share of the three data.packing modes, on 2 gloo ranks.

A chat-like data set (prompt without loss, then a reply; lengths drawn log-normally around a quarter of
``seq_len``) is made into the worker's tables with ``jobs.data.build_sequences``: one example per row
(``false``), concatenated and cut (``naive``) and boundary-aware (``true``, whole examples by best-fit
decreasing, per-example positions, attention within each example). The worker's own code trains on each, in
the same two rank processes, on the same FSDP2 Llama (``jobs.model.load_model``, ``jobs.step.train_step``,
fused AdamW as ``jobs/train.py``), with the same step shape (micro_batch x grad_accum rows of seq_len):
modes take turns in rounds (order rotated every round), a warm-up step each time a mode comes up, medians over
the timed steps. Real tokens/s is the global batch's target tokens (the loss's denominator) over the step's
wall time; the padding share is the rows' pad positions over all positions.

    OMP_NUM_THREADS=1 python bench/packing.py                 # seq 512, 2 ranks, 3 rounds (about 3 minutes)
    OMP_NUM_THREADS=1 python bench/packing.py --rounds 5 --steps 6
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))  # run_ranks

from distributed import run_ranks  # noqa: E402

MODES = {"unpacked": False, "naive": "naive", "boundary-aware": True}


def chat_like(n: int, seq_len: int, vocab: int, seed: int):
    """Examples with log-normal lengths (median seq_len / 4, sigma 0.6, at least 8 tokens): a third prompt."""
    import torch

    from fsdpjob.jobs.data import IGNORE, Example

    gen = torch.Generator().manual_seed(seed)
    lengths = torch.exp(math.log(seq_len / 4) + 0.6 * torch.randn(n, generator=gen)).round().clamp(min=8).long()
    out = []
    for i, length in enumerate(lengths.tolist()):
        ids = torch.randint(3, vocab, (length,), generator=gen).tolist()
        prompt = length // 3
        out.append(Example(ids, [IGNORE] * prompt + ids[prompt:], i + 1))
    return out


def write_model(path: Path, args: argparse.Namespace) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                         num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
                         num_key_value_heads=max(1, args.hidden // 128), max_position_embeddings=args.seq_len,
                         pad_token_id=0, bos_token_id=1, eos_token_id=2)
    LlamaForCausalLM(config).save_pretrained(path)


def bench_rank(rank: int, world_size: int, *, model_dir: str, args: dict) -> dict:
    """Per mode: the step times this rank measured, and the tables' target and pad shares."""
    import torch
    import torch.distributed as dist

    from fsdpjob.jobs.data import BatchStream, build_sequences, packing_mode
    from fsdpjob.jobs.dist import close_distributed, init_distributed
    from fsdpjob.jobs.model import NONE, load_model
    from fsdpjob.jobs.model.parallelize import build_mesh
    from fsdpjob.jobs.step import train_step

    a = argparse.Namespace(**args)
    env = init_distributed(600)
    try:
        mesh = build_mesh(env, 1)
        model = load_model(model_dir, env=env, mesh=mesh, dtype=torch.float32, attn_implementation="sdpa",
                           mixed_precision="fp32", reshard_after_forward=True, activation_checkpointing=NONE,
                           cpu_offload=False)
        model.train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, betas=(0.9, 0.95), fused=True)
        examples = chat_like(a.examples, a.seq_len, a.vocab, seed=0)
        streams, shares = {}, {}
        for name, packing in MODES.items():
            table = build_sequences(examples, a.seq_len, packing, pad_id=0)
            streams[name] = BatchStream(table, seed=0, shuffle=True, micro_batch_size=a.micro_batch,
                                        grad_accum_steps=a.grad_accum, dp_rank=env.rank, dp_world=world_size,
                                        packing=packing_mode(packing))
            shares[name] = {"rows": len(table), "pad_share": 1 - table.efficiency}
        times: dict[str, list[float]] = {name: [] for name in MODES}
        tokens: dict[str, list[int]] = {name: [] for name in MODES}
        names = list(MODES)
        for r in range(a.rounds):
            for name in names[r % len(names):] + names[: r % len(names)]:
                for i in range(a.steps + 1):  # the first of each turn warms up
                    batch = streams[name].next_step()
                    dist.barrier()
                    start = time.perf_counter()
                    values = train_step(model, optimizer, batch.micro_batches, env.device, tokens=batch.tokens,
                                        max_grad_norm=1.0, processed=batch.processed)
                    _ = values.loss  # the step's collective read, as a logged step does
                    dist.barrier()
                    if i:
                        times[name].append(time.perf_counter() - start)
                        tokens[name].append(batch.tokens)
        return {"times": times, "tokens": tokens, "shares": shares}
    finally:
        close_distributed()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--examples", type=int, default=2000)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--grad-accum", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=4, help="timed steps per mode per round")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--world", type=int, default=2)
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as tmp:
        write_model(Path(tmp) / "model", args)
        results = run_ranks(bench_rank, args.world, timeout=3600, model_dir=str(Path(tmp) / "model"),
                            args=vars(args))
    params = 12 * args.layers * args.hidden**2 + 2 * args.vocab * args.hidden
    print(f"Llama ~{params / 1e6:.1f} M params (hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}), "
          f"{args.world} gloo ranks, fp32, sdpa; seq_len {args.seq_len}, {args.micro_batch} x {args.grad_accum} "
          f"rows per rank per step; {args.examples} examples, log-normal lengths around seq_len / 4; "
          f"{args.rounds} rounds x {args.steps} timed steps per mode; load average {os.getloadavg()[0]:.1f}")
    print(f"{'mode':<15} {'rows':>6} {'pad share':>9} {'step s':>7} {'targets/step':>12} {'real tok/s':>10} "
          f"{'vs naive':>8}")
    rows = {}
    for name in MODES:
        # A step ends when its slowest rank does: the max over ranks of each step's time.
        steps = [max(r["times"][name][i] for r in results) for i in range(len(results[0]["times"][name]))]
        rows[name] = (statistics.median(steps), statistics.median(results[0]["tokens"][name]),
                      sum(results[0]["tokens"][name]) / sum(steps))
    rates = {name: row[2] for name, row in rows.items()}
    for name, (step_s, targets, rate) in rows.items():
        share = results[0]["shares"][name]
        print(f"{name:<15} {share['rows']:>6} {share['pad_share']:>9.1%} {step_s:>7.3f} {targets:>12.0f} "
              f"{rate:>10.0f} {rate / rates['naive']:>7.2f}x")
    print(f"boundary-aware / naive: {rates['boundary-aware'] / rates['naive']:.2f}x real tokens/s (target >= 0.9); "
          f"/ unpacked: {rates['boundary-aware'] / rates['unpacked']:.2f}x (target > 1)")


if __name__ == "__main__":
    main()
