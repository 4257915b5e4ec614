"""Issue 41's memory savers on the workers, on 2 gloo ranks of a tiny Llama with a large vocabulary (the logits
dominate): the training step's peak host memory with the standard and the chunked loss (train.loss), and the
optimizer states' bytes with fp32 and bf16 moments (train.optimizer_state_dtype).

The peak is the rise of each fresh rank process's high-water mark (VmHWM: its own address space's; ru_maxrss is
not, as Linux carries the spawning process's high-water mark across fork and exec into it, so a rank started by a
pytest worker that once held 1 GiB reads a rise of 0) over one train_step, after a step on 8 tokens per row has
paid what any first step costs (lazy initialisation, thread pools: ~340 MiB here, more than the logits). The ranks
run with glibc's mmap threshold fixed at 64 KiB (MALLOC_MMAP_THRESHOLD_, read at process start, inherited by the
spawned ranks): by default glibc raises the threshold to the largest block freed so far, after which the chunks'
logits come from the heap, whose freed pages stay resident, and the high-water mark counts every chunk's logits
though only one is alive at a time (172 MiB against 24 in the chunked backward of this model). With the threshold
fixed, a freed block goes back to the system and the mark follows the live peak.

    OMP_NUM_THREADS=1 python bench/savers_memory.py [--vocab 32000] [--seq 512] [--rows 2] [--chunk 128]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))  # run_ranks

from common import proc_status_mib  # noqa: E402
from distributed import run_ranks  # noqa: E402

MMAP_THRESHOLD = "65536"


def save_model(path: Path, *, vocab: int, **config) -> Path:
    import torch
    from transformers import AutoModelForCausalLM

    from fsdpjob.jobs.quickstart import tiny_config

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tiny_config("llama", vocab_size=vocab, **config)).save_pretrained(path)
    return path


def load(path: Path, env, *, mixed_precision: str = "fp32", **options):
    """The worker's load_model with the CPU tests' settings (fp32, sdpa, no checkpointing, no offload)."""
    import torch

    from fsdpjob.jobs.model.build import load_model
    from fsdpjob.jobs.model.checkpointing import NONE
    from fsdpjob.jobs.model.parallelize import build_mesh

    return load_model(path, env=env, mesh=build_mesh(env, 1), dtype=torch.float32, attn_implementation="sdpa",
                      mixed_precision=mixed_precision, reshard_after_forward=True, activation_checkpointing=NONE,
                      cpu_offload=False, **options)


def _step_peak(rank: int, world_size: int, path: Path, vocab: int, seq: int, rows: int, chunk_tokens: int,
               state_dtype: str) -> dict:
    """One rank: the rise of its high-water mark over one train_step (MiB) and its optimizer states' bytes."""
    import torch

    from fsdpjob.jobs.data import MicroBatch
    from fsdpjob.jobs.dist import close_distributed, init_distributed
    from fsdpjob.jobs.optim import build_optimizer, state_bytes
    from fsdpjob.jobs.step import train_step
    from fsdpjob.orchestrator.core.jobspec.spec import TrainSpec

    env = init_distributed(120)
    model = load(path, env)
    optimizer = build_optimizer(model.parameters(), TrainSpec(max_steps=2, optimizer_state_dtype=state_dtype))
    ids = torch.randint(0, vocab, (rows, seq), generator=torch.Generator().manual_seed(100 + rank))
    labels = ids.clone()
    labels[:, :5] = -100
    tokens = world_size * rows * seq

    def step(n: int, chunk: int) -> float:
        mb = MicroBatch(ids[:, :n], labels[:, :n], torch.arange(rows), torch.arange(rows))
        return train_step(model, optimizer, [mb], env.device, tokens=tokens, max_grad_norm=1.0,
                          chunk_tokens=chunk).loss

    step(8, 0)
    before = proc_status_mib("VmHWM")
    loss = step(seq, chunk_tokens)
    after = proc_status_mib("VmHWM")
    close_distributed()
    return {"rise_mib": after - before, "loss": loss, "state_bytes": state_bytes(optimizer)}


def measure(path: Path, *, vocab: int, seq: int, rows: int, chunk_tokens: int, state_dtype: str = "float32") -> dict:
    """The larger rank's step peak rise, the loss, and rank 0's state bytes, in fresh rank processes."""
    previous = os.environ.get("MALLOC_MMAP_THRESHOLD_")
    os.environ["MALLOC_MMAP_THRESHOLD_"] = MMAP_THRESHOLD
    try:
        results = run_ranks(_step_peak, 2, timeout=600, path=path, vocab=vocab, seq=seq, rows=rows,
                            chunk_tokens=chunk_tokens, state_dtype=state_dtype)
    finally:
        if previous is None:
            del os.environ["MALLOC_MMAP_THRESHOLD_"]
        else:
            os.environ["MALLOC_MMAP_THRESHOLD_"] = previous
    return {"rise_mib": max(r["rise_mib"] for r in results), "loss": results[0]["loss"],
            "state_bytes": results[0]["state_bytes"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--rows", type=int, default=2, help="rows per rank")
    parser.add_argument("--chunk", type=int, default=128, help="the chunked loss's tokens per chunk")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = save_model(Path(tmp) / "m", vocab=args.vocab, max_position_embeddings=args.seq)
        shape = dict(vocab=args.vocab, seq=args.seq, rows=args.rows)
        standard = measure(path, chunk_tokens=0, **shape)
        chunked = measure(path, chunk_tokens=args.chunk, **shape)
        bf16 = measure(path, chunk_tokens=0, state_dtype="bfloat16", **shape)
    logits_mib = args.rows * args.seq * args.vocab * 4 / 2**20
    print(f"vocab {args.vocab}, {args.rows} x {args.seq} tokens per rank: one fp32 copy of the logits "
          f"{logits_mib:.0f} MiB; chunk {args.chunk} tokens; load average {os.getloadavg()[0]:.1f}")
    print(f"step peak rise   standard {standard['rise_mib']:7.1f} MiB   chunked {chunked['rise_mib']:7.1f} MiB   "
          f"ratio {chunked['rise_mib'] / standard['rise_mib']:.3f}")
    print(f"loss             standard {standard['loss']:.6f}   chunked {chunked['loss']:.6f}")
    print(f"optimizer states fp32 {standard['state_bytes']} B   bf16 {bf16['state_bytes']} B   "
          f"ratio {bf16['state_bytes'] / standard['state_bytes']:.3f}")


if __name__ == "__main__":
    main()
