"""LoRA against full fine-tuning on the same model: checkpoint bytes and save time, and peak memory per rank
measured against the planner's figure.

Each mode runs the worker's own code on spawned gloo ranks: ``jobs.model.load_model`` (meta init, peft
injection for LoRA, activation checkpointing, FSDP2, rank-0 read and broadcast), AdamW over the parameters
that train (as ``jobs/train.py``), two ``jobs.step.train_step`` calls, then ``--saves`` synchronous checkpoint
saves through ``jobs.checkpoint.CheckpointManager`` with the state the worker saves (trainable-only for LoRA).
Peak memory is measured as in ``bench/plan_accuracy.py`` (VmHWM above the RSS after imports, process group
and a warm-up step) and set against ``make_plan``'s per-rank peak on the CPU profile (without its fixed
process item); the plan's checkpoint bytes against the bytes on disk.

    OMP_NUM_THREADS=1 python bench/lora.py          # 2 ranks, 6.3 M-parameter Llama, fp32, r 16 all-linear
    OMP_NUM_THREADS=1 python bench/lora.py --size L --mp bf16 --ac --saves 5
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))  # run_ranks
sys.path.insert(0, str(REPO / "bench"))

from distributed import run_ranks  # noqa: E402
from plan_accuracy import (  # noqa: E402
    FROZEN_MMAP_THRESHOLD,
    SIZES,
    Case,
    _load,
    _reset_peak,
    _status_kib,
    _train,
    _warmup,
    write_model,
)

MiB = 1024**2


def spec_for(case: Case, model_dir: Path, lora: dict | None):
    from fsdpjob.orchestrator.core.jobspec.spec import JobSpec

    return JobSpec.model_validate({
        "name": "lora-bench",
        "resources": {"tasks_per_node": case.world},
        "model": {"path": str(model_dir), "dtype": case.dtype, "activation_checkpointing": case.ac,
                  "attn_implementation": case.attn, **({"lora": lora} if lora is not None else {})},
        "data": {"path": "unused.jsonl", "seq_len": case.seq_len},
        "train": {"max_steps": 2, "micro_batch_size": case.micro_batch, "grad_accum_steps": case.grad_accum},
        "fsdp": {"mixed_precision": case.mp, "reshard_after_forward": case.reshard},
    })


def plan(case: Case, model_dir: Path, lora: dict | None):
    from fsdpjob.orchestrator.core.jobspec.profiles import load_profile
    from fsdpjob.orchestrator.planner.fit import make_plan
    from fsdpjob.orchestrator.planner.resolve import resolve

    return make_plan(resolve(spec_for(case, model_dir, lora), load_profile("local")))


def bench_rank(rank: int, world_size: int, *, model_dir: str, case: dict, lora: dict | None, ckpt_dir: str,
               saves: int) -> dict:
    """This rank's training peak above its baseline, its save times, and (rank 0) the checkpoint's bytes."""
    import torch
    import torch.distributed as dist

    from fsdpjob.jobs.checkpoint import CheckpointManager
    from fsdpjob.jobs.checkpoint.state import ModelOptimState
    from fsdpjob.jobs.dist import close_distributed, init_distributed
    from fsdpjob.jobs.model import FULL, NONE, load_model
    from fsdpjob.jobs.model.lora import trainable_parameters
    from fsdpjob.jobs.model.parallelize import build_mesh
    from fsdpjob.jobs.step import train_step
    from fsdpjob.orchestrator.core.jobspec.spec import LoraSpec

    c = Case(**case)
    env = init_distributed(600)
    try:
        mesh = build_mesh(env, 1)
        _train(_load(str(Path(model_dir) / "warmup"), _warmup(c), env, mesh), _warmup(c), env, 1)
        if lora is not None:
            import peft  # noqa: F401 - its import (~60 MiB) is the process's, as transformers' is, not training's
        gc.collect()
        dist.barrier()
        _reset_peak()
        base = _status_kib("VmRSS") * 1024
        model = load_model(model_dir, env=env, mesh=mesh, dtype=getattr(torch, c.dtype), attn_implementation=c.attn,
                           mixed_precision=c.mp, reshard_after_forward=c.reshard,
                           activation_checkpointing=FULL if c.ac else NONE,
                           cpu_offload=False, lora=LoraSpec(**lora) if lora is not None else None)
        model.train()
        _reset_peak()
        optimizer = torch.optim.AdamW(trainable_parameters(model), lr=1e-4, betas=(0.9, 0.95))
        gen = torch.Generator().manual_seed(env.rank)
        from fsdpjob.jobs.data import MicroBatch, count_tokens

        for _ in range(2):
            ids = torch.randint(0, c.vocab, (c.micro_batch, c.seq_len), generator=gen)
            batch = MicroBatch(ids, ids.clone(), torch.zeros(c.micro_batch), torch.zeros(c.micro_batch))
            train_step(model, optimizer, [batch], env.device, tokens=count_tokens(ids) * world_size, max_grad_norm=1.0)
        peak = _status_kib("VmHWM") * 1024 - base
        ckpt = CheckpointManager(Path(ckpt_dir), rank=rank, world_size=world_size, keep_last=1, async_save=False,
                                 sidecar={})
        state = {"model": ModelOptimState(model, optimizer, trainable_only=lora is not None)}
        times = []
        for step in range(1, saves + 1):
            dist.barrier()
            start = time.perf_counter()
            ckpt.save(step, state, reason="interval")
            times.append(time.perf_counter() - start)
        step_dir = ckpt.latest_committed()
        size = sum(f.stat().st_size for f in step_dir.iterdir() if f.is_file()) if rank == 0 else 0
        ckpt.close()
        return {"peak": peak, "save_s": times, "bytes": size}
    finally:
        close_distributed()


def run_mode(case: Case, model_dir: Path, lora: dict | None, saves: int, work: Path, frozen: bool) -> dict:
    ckpt_dir = work / ("ckpt-lora" if lora is not None else "ckpt-full") / ("frozen" if frozen else "stock")
    saved = os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)
    if frozen:  # spawned ranks inherit it at exec: RSS then tracks live tensors (see plan_accuracy.py)
        os.environ["MALLOC_MMAP_THRESHOLD_"] = FROZEN_MMAP_THRESHOLD
    try:
        results = run_ranks(bench_rank, case.world, timeout=1800, model_dir=str(model_dir), case=asdict(case),
                            lora=lora, ckpt_dir=str(ckpt_dir), saves=saves)
    finally:
        os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)
        if saved is not None:
            os.environ["MALLOC_MMAP_THRESHOLD_"] = saved
    p = plan(case, model_dir, lora)
    return {
        "plan": p,
        "predicted_peak": p.device.peak - p.device.runtime.bytes,
        "peaks": [r["peak"] for r in results],
        "save_s": statistics.median(max(r["save_s"][i] for r in results) for i in range(saves)),
        "bytes": results[0]["bytes"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="M", help="model size of bench/plan_accuracy.py")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--mp", choices=["fp32", "bf16"], default="fp32", help="fsdp.mixed_precision")
    ap.add_argument("--ac", action="store_true", help="activation checkpointing")
    ap.add_argument("--r", type=int, default=16)
    ap.add_argument("--saves", type=int, default=3, help="saves per mode; the median is shown")
    ap.add_argument("--frozen", action="store_true", help="also measure with glibc's mmap threshold frozen at 128 KiB")
    args = ap.parse_args()
    # Default: plan_accuracy's third quick case (M, 2 ranks, fp32), where the full fine-tune's plan is checked.
    case = replace(Case(args.size, **SIZES[args.size]), world=args.world, mp=args.mp, ac=args.ac)
    lora = {"r": args.r, "alpha": 2 * args.r, "target_modules": "all-linear"}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_model(case, Path(tmp) / "model")
        write_model(_warmup(case), model_dir / "warmup")
        modes = {"full": run_mode(case, model_dir, None, args.saves, Path(tmp), False),
                 "lora": run_mode(case, model_dir, lora, args.saves, Path(tmp), False)}
        if args.frozen:
            modes |= {"full, frozen malloc": run_mode(case, model_dir, None, args.saves, Path(tmp), True),
                      "lora, frozen malloc": run_mode(case, model_dir, lora, args.saves, Path(tmp), True)}
    total = modes["full"]["plan"].params.total
    print(f"model: Llama {args.size} ({total / 1e6:.1f} M params), {case.world} gloo ranks, {case.mp} compute"
          f"{', AC' if case.ac else ''}, seq {case.seq_len} x {case.micro_batch}; LoRA r {args.r} on all-linear; "
          f"{args.saves} saves each")
    print(f"{'mode':<19} {'trains':>10} {'ckpt plan MB':>12} {'ckpt disk MB':>12} {'save s':>7} "
          f"{'peak plan MiB':>13} {'peak MiB per rank':>18} {'error':>7}")
    for name, m in modes.items():
        worst = max(m["peaks"])
        trains = m["plan"].trainable.trained
        print(f"{name:<19} {trains / 1e6:>9.2f}M {m['plan'].timing.checkpoint_bytes / 1e6:>12.2f} "
              f"{m['bytes'] / 1e6:>12.2f} {m['save_s']:>7.3f} {m['predicted_peak'] / MiB:>13.1f} "
              f"{' / '.join(f'{p / MiB:.1f}' for p in m['peaks']):>18} "
              f"{(m['predicted_peak'] - worst) / worst:>+7.1%}")
    full, lo = modes["full"], modes["lora"]
    print(f"LoRA / full: checkpoint {lo['bytes'] / full['bytes']:.3f}x the bytes, save "
          f"{lo['save_s'] / full['save_s']:.2f}x the time, peak memory {max(lo['peaks']) / max(full['peaks']):.2f}x")


if __name__ == "__main__":
    main()
