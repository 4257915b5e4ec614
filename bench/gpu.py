"""GPU smoke benchmark: the real fsdpjob worker on one NVIDIA GPU with a ~1.2B-parameter Llama-shape model.

    python bench/gpu.py            # bf16 mixed precision, activation checkpointing, 40 steps; < 8 minutes
    python bench/gpu.py --tiny     # the same path on CPU with a tiny model (checks the script itself)

Builds the model (random init, save_pretrained), a tokenizer and a synthetic data set locally (no downloads),
runs `fsdpjob.jobs.train.run` as a world-size-1 FSDP2 job, and prints tokens/s, model FLOP utilisation and
peak memory from the worker's own metrics.jsonl (the first logged window is warm-up and is left out).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path


def build_assets(root: Path, tiny: bool) -> tuple[str, str]:
    from fsdpjob.jobs.assets import build_tiny_model, build_tokenizer

    rng = random.Random(0)
    words = ["alpha", "beta", "gamma", "delta", "tensor", "shard", "gather", "reduce", "token", "layer"]
    lines = [" ".join(rng.choice(words) + str(rng.randrange(1000)) for _ in range(400)) for _ in range(600)]
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in lines))
    model = root / "model"
    build_tokenizer(model, lines, vocab_size=4096)
    shape = (
        dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128)
        if tiny
        else dict(hidden_size=2048, num_layers=24, num_heads=16, num_kv_heads=8, intermediate_size=5632)
    )
    build_tiny_model(model, arch="llama", max_position_embeddings=4096, **shape)
    return str(model), str(data)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="tiny model on CPU: checks the script, not the GPU")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--micro-batch", type=int, default=4)
    args = parser.parse_args()
    import torch

    if not args.tiny and not torch.cuda.is_available():
        sys.exit("no CUDA device: run on a GPU machine, or pass --tiny to check the script on CPU")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29533", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    from fsdpjob.jobs.train import run
    from fsdpjob.orchestrator.core.spec import JobSpec

    with tempfile.TemporaryDirectory(prefix="fsdpjob-gpu-") as tmp:
        root = Path(tmp)
        t0 = time.time()
        model_path, data_path = build_assets(root, args.tiny)
        seq = 128 if args.tiny else args.seq_len
        spec = JobSpec.model_validate({
            "name": "gpu-bench",
            "model": {"path": model_path, "activation_checkpointing": True},
            "data": {"path": data_path, "seq_len": seq},
            "train": {"max_steps": args.steps, "micro_batch_size": args.micro_batch, "lr": 1e-4, "log_every": 5},
            "fsdp": {"mixed_precision": "bf16"},
            "checkpoint": {"interval_steps": 0, "interval_minutes": 0},
        })
        run_dir = root / "run"
        run_dir.mkdir()
        (run_dir / "spec.json").write_text(json.dumps({"spec": spec.model_dump(mode="json"), "resume_from": None}))
        setup_s = time.time() - t0
        t1 = time.time()
        run(str(run_dir))
        metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steady = [m for m in metrics if m["step"] > 5] or metrics
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    print(f"device            {device}")
    print(f"model             llama {'tiny' if args.tiny else '2048x24 (~1.2B params)'}, bf16 mixed precision, activation checkpointing")
    print(f"batch             {args.micro_batch} x {seq} tokens per step, {args.steps} steps")
    print(f"tokens/s          {statistics.median(m['tokens_per_s'] for m in steady):.0f} (median of logged windows after warm-up)")
    print(f"MFU               {statistics.median(m['mfu'] for m in steady):.3f} (vs. the device's dense bf16 peak)")
    print(f"peak memory       {max(m['peak_mem_mb'] for m in metrics):.0f} MiB ({'CUDA allocator' if device != 'cpu' else 'RSS'})")
    print(f"final loss        {metrics[-1]['loss']:.4f} (first {metrics[0]['loss']:.4f})")
    print(f"time              assets {setup_s:.0f} s, training job {time.time() - t1:.0f} s")


if __name__ == "__main__":
    main()
