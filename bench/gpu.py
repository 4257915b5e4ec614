"""GPU benchmark: the real fsdpjob worker on one NVIDIA GPU against a bare FSDP2 loop, ~1.2B Llama shape, bf16.

    python bench/gpu.py            # 3 cases x 40 steps, 4 x 2048 tokens per step; < 8 minutes on an H200
    python bench/gpu.py --tiny     # the same cases on CPU with a tiny model (checks the script itself)
    python bench/gpu.py --cases bare fsdpjob      # leave out the torch.compile case

Builds the model (random init, save_pretrained), a tokenizer and a synthetic data set locally (no downloads),
then runs each case in its own process, one after the other, on the same model, data, batch and precision
(bf16 parameters, fp32 gradient reduction, fp32 master weights, activation checkpointing, fused AdamW):

- ``bare``: bench/bare_fsdp2.py under torchrun (1 process): from_pretrained, fully_shard per decoder layer
  then the root, a plain loop that reads its loss every step;
- ``fsdpjob``: the worker (`fsdpjob.jobs.train.run`) as a world-size-1 FSDP2 job, data read in order;
- ``fsdpjob-compile``: the same with ``model.compile: true`` (torch.compile of each decoder block).

Prints tokens/s over the steps after the warm-up (step-end time stamps; the first steps pay CUDA's and
the compiler's warm-up), each case's ratio to the bare loop, model FLOP utilisation (6N FLOPs per token
against the device's dense bf16 peak, as the worker's metrics compute it), peak memory and the losses.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
CASES = ("bare", "fsdpjob", "fsdpjob-compile")
LR = 1e-4  # constant in every case


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


def run_bare(root: Path, model: str, data: str, args: argparse.Namespace) -> dict[int, float]:
    out = root / "bare.json"
    device = ["--device", "cpu"] if args.tiny else ["--device", "cuda"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "--master-port", str(args.port),
           str(HERE / "bare_fsdp2.py"), "--model", model, "--data", data, "--seq-len", str(args.seq),
           "--micro-batch", str(args.micro_batch), "--steps", str(args.steps), "--lr", str(LR),
           "--activation-checkpointing", "--bf16", *device, "--out", str(out)]  # fmt: skip
    subprocess.run(cmd, check=True, stdout=sys.stderr)
    record = json.loads(out.read_text())
    return {"ends": dict(enumerate(record["times"])), "losses": record["losses"],
            "peak_mem_mb": record["info"].get("peak_mem_mb")}  # fmt: skip



def run_fsdpjob(root: Path, model: str, data: str, args: argparse.Namespace, compile_layers: bool) -> dict:
    from fsdpjob.orchestrator.core.spec import JobSpec

    name = "fsdpjob-compile" if compile_layers else "fsdpjob"
    spec = JobSpec.model_validate({
        "name": name,
        "model": {"path": model, "activation_checkpointing": True, "compile": compile_layers},
        "data": {"path": data, "seq_len": args.seq, "shuffle": False, "packing": "naive"},  # the bare loop's rows
        "train": {"max_steps": args.steps, "micro_batch_size": args.micro_batch, "lr": LR, "lr_schedule": "constant",
                  "log_every": 1},  # the bare loop reads its loss every step too
        "fsdp": {"mixed_precision": "bf16"},
        "checkpoint": {"interval_steps": 0, "interval_minutes": 0},
    })  # fmt: skip
    run_dir = root / name
    run_dir.mkdir()
    (run_dir / "spec.json").write_text(json.dumps({"spec": spec.model_dump(mode="json"), "resume_from": None}))
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port), RANK="0", WORLD_SIZE="1",
               LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")  # fmt: skip
    code = "import sys; from fsdpjob.jobs.train import run; run(sys.argv[1])"
    subprocess.run([sys.executable, "-c", code, str(run_dir)], check=True, env=env, stdout=sys.stderr)
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in metrics if "loss" in m]
    return {"ends": {m["step"]: m["time"] for m in steps}, "losses": [m["loss"] for m in steps],
            "peak_mem_mb": max(m["peak_mem_mb"] for m in steps), "mfu_worker": [m["mfu"] for m in steps]}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="tiny model on CPU: checks the script, not the GPU")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=10, help="first steps left out of tokens/s")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES))
    parser.add_argument("--port", type=int, default=29533)
    args = parser.parse_args()
    import torch

    from fsdpjob.jobs.metrics import mfu

    if not args.tiny and not torch.cuda.is_available():
        sys.exit("no CUDA device: run on a GPU machine, or pass --tiny to check the script on CPU")
    if args.tiny:
        args.steps, args.warmup = min(args.steps, 8), min(args.warmup, 3)
    args.seq = 128 if args.tiny else args.seq_len
    tokens_per_step = args.micro_batch * args.seq
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    results = {}
    with tempfile.TemporaryDirectory(prefix="fsdpjob-gpu-") as tmp:
        root = Path(tmp)
        t0 = time.time()
        model, data = build_assets(root, args.tiny)
        from transformers import AutoConfig

        from fsdpjob.jobs.model import model_flops_per_token

        flops_per_token = model_flops_per_token(AutoConfig.from_pretrained(model), seq_len=args.seq)
        print(f"assets            {time.time() - t0:.0f} s", flush=True)
        for case in args.cases:
            t1 = time.time()
            if case == "bare":
                r = run_bare(root, model, data, args)
            else:
                r = run_fsdpjob(root, model, data, args, compile_layers=case == "fsdpjob-compile")
            ends = r["ends"]
            r["rate"] = (args.steps - args.warmup) * tokens_per_step / (ends[args.steps] - ends[args.warmup])
            r["wall_s"] = time.time() - t1
            results[case] = r
            print(f"{case:<17} {r['rate']:.0f} tok/s, {r['wall_s']:.0f} s", flush=True)

    name = torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu"
    shape = "tiny" if args.tiny else "2048 x 24 layers (~1.2B params)"
    print(f"\ndevice   {name}, torch {torch.__version__}")
    print(f"model    llama {shape}, bf16 mixed precision, activation checkpointing, fused AdamW on GPU")
    print(f"batch    {args.micro_batch} x {args.seq} tokens per step; steps {args.warmup + 1}-{args.steps} timed")
    base = results.get("bare", {}).get("rate")
    print("\n| case | tok/s | / bare | MFU | peak memory MiB | loss step 1 -> last |")
    print("|---|---|---|---|---|---|")
    for case, r in results.items():
        ratio = f"{r['rate'] / base:.2f}" if base else "-"
        util = mfu(flops_per_token, r["rate"], 1.0, device, 1)
        util_text = f"{util:.3f}" if util is not None else "-"
        peak = f"{r['peak_mem_mb']:.0f}" if r.get("peak_mem_mb") else "-"
        print(f"| {case} | {r['rate']:.0f} | {ratio} | {util_text} | {peak} | {r['losses'][0]:.4f} -> {r['losses'][-1]:.4f} |")


if __name__ == "__main__":
    main()
