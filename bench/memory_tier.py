"""The memory checkpoint tier's cost in the loop: the stall of one snapshot against the step time, A/B inside the
same two processes.

    python bench/memory_tier.py [--size 19M] [--blocks 6] [--steps-per-block 10] [--every 5] [--peak N] [--cpu N]

Two gloo ranks (torchrun, one thread each) emulate two nodes (SLURMD_NODENAME n1, n2), so every snapshot also
sends its replica to the other rank. One model, optimizer and batch stream; blocks of steps alternate between
``off`` (no tier) and ``on`` (jobs/checkpoint/memory/tier.py's MemoryTier.save every ``--every`` steps, into a
folder under /dev/shm, from the block's first step on, so that every commit overlaps the steps after it and the
block's end waits only for what is left of its last one), the order reversed every other block, so both share the
load and the clock. Reported:

- ``stall per snapshot``: the loop's own time in save() plus the optimizer's wait for the background copy
  (MemoryTier.waited_s), median over snapshots, and as a fraction of the median ``off`` step (target <= 0.05);
- ``on``/``off`` ms per step (medians of blocks): what the background copy, the write and the replica cost the
  steps around them on 2 shared cores (they run on the same cores as the step);
- the tier's bytes per node (own shards + the replica).

``--peak N`` instead measures the host RAM a snapshot with its replica adds inside a rank's process: after one
step, N snapshots each taken alone (save + wait, nothing else running), each rank's RssAnon (its own memory; the
tier's files are shared memory mapped in, counted once per node by the plan, planner/memory.py memory_tier_bytes)
sampled every millisecond, its largest rise. The plan counts nothing of the state's size here: the copy goes
straight into the mapped file and the replica between two mapped files.

``--cpu N`` instead gives the CPU time of N snapshots, each alone, and of their parts (bench/memory_tier_cpu.py):
what the background work of a snapshot takes from the cores the step runs on.

Steps lost per crash are the dev cluster's (tests/slurm/test_memory_tier_slurm.py reports them; bench/RESULTS.md).
Nothing is asserted.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
MICRO = 4  # rows per micro-batch
sys.path.insert(0, str(BENCH))
import memory_tier_cpu  # noqa: E402  (bench/, on the path just above)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="19M", help="a size of bench/worker_throughput.py (0.1M, 19M)")
    parser.add_argument("--blocks", type=int, default=6, help="turns per variant")
    parser.add_argument("--steps-per-block", type=int, default=10)
    parser.add_argument("--every", type=int, default=5, help="memory_interval_steps")
    parser.add_argument("--peak", type=int, default=0, metavar="N",
                        help="measure the host peak of N snapshots alone instead of the A/B")
    parser.add_argument("--cpu", type=int, default=0, metavar="N",
                        help="measure the CPU time of N snapshots alone and of their parts instead of the A/B")
    parser.add_argument("--model", help="(set by the launcher) model folder")
    parser.add_argument("--data", help="(set by the launcher) JSONL text")
    parser.add_argument("--shm", help="(set by the launcher) the tier's base folder")
    args = parser.parse_args(argv)
    if args.steps_per_block % args.every:
        parser.error("--steps-per-block must be a multiple of --every (each block snapshots at the interval's rate)")
    return args


def launch(args: argparse.Namespace) -> int:
    from common import free_port, make_assets
    from worker_throughput import SIZES

    with tempfile.TemporaryDirectory(prefix="fsdpjob-memtier-") as tmp, \
            tempfile.TemporaryDirectory(prefix="fsdpjob-memtier-bench-", dir="/dev/shm") as shm:
        model, data = make_assets(Path(tmp), SIZES[args.size])
        # torch.distributed.run is torchrun's module: a venv without the console script (torch from another
        # site) launches it all the same
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
               "--master-port", str(free_port()),
               __file__, "--model", str(model), "--data", str(data), "--blocks", str(args.blocks),
               "--steps-per-block", str(args.steps_per_block), "--every", str(args.every), "--size", args.size,
               "--shm", shm, "--peak", str(args.peak), "--cpu", str(args.cpu)]  # fmt: skip
        return subprocess.run(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), check=False).returncode


@dataclass
class Bench:
    """One rank's model, optimizer, state and tier, and its batch stream."""

    rank: int
    world: int
    state: dict[str, Any]
    tier: Any  # jobs/checkpoint/memory.MemoryTier
    step: Callable[[int], None]  # trains step n (1-based) on this rank's rows


def setup(args: argparse.Namespace) -> Bench:
    import bare_fsdp2
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from fsdpjob.jobs.checkpoint.memory.tier import MemoryTier
    from fsdpjob.jobs.checkpoint.state import ModelOptimState, RNGState
    from fsdpjob.jobs.data import MicroBatch, count_tokens
    from fsdpjob.jobs.dist import DistEnv
    from fsdpjob.jobs.model import NONE, load_model
    from fsdpjob.jobs.step import train_step
    from fsdpjob.orchestrator.core.runfolder.memtier import TierKey
    from fsdpjob.orchestrator.core.runfolder.sidecar import RunFacts

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    os.environ["SLURMD_NODENAME"] = f"n{rank + 1}"
    micro, per = MICRO, args.steps_per_block
    rows = bare_fsdp2.packed_rows(args.model, args.data, 128, micro * world * per)
    cpu = torch.device("cpu")
    env = DistEnv(rank, world, rank, world, "127.0.0.1", 0, "gloo", cpu)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
    model = load_model(args.model, env=env, mesh=mesh, dtype=torch.float32, attn_implementation="sdpa",
                       mixed_precision="fp32", reshard_after_forward=True, activation_checkpointing=NONE,
                       cpu_offload=False).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.0, fused=True)
    state = {"model": ModelOptimState(model, optimizer), "rng": RNGState(0, rank, world),
             "train": {"step": 0, "tokens_seen": 0}}
    tier = MemoryTier(args.shm, TierKey("bench", 0, "bench"), rank=rank, world_size=world, interval_steps=args.every,
                      run=RunFacts.of({}))
    tokens = count_tokens(rows[: micro * world])

    def step(n: int) -> None:
        first = (n - 1) % per * micro * world + rank * micro
        train_step(model, optimizer, [MicroBatch(rows[first: first + micro], rows[first: first + micro], None, None)],
                   cpu, tokens=tokens, max_grad_norm=1.0)
        state["train"] = {"step": n, "tokens_seen": n * tokens}

    return Bench(rank, world, state, tier, step)


def run_ab(args: argparse.Namespace, b: Bench) -> None:
    import torch.distributed as dist

    tier, per = b.tier, args.steps_per_block
    times: dict[str, list[float]] = {"off": [], "on": []}
    stalls: list[float] = []
    step = 0
    for block in range(args.blocks):
        for name in ("off", "on") if block % 2 == 0 else ("on", "off"):
            dist.barrier()
            start = time.perf_counter()
            for i in range(per):
                step += 1
                b.step(step)
                # After the block's 1st, (every+1)-th, ... step, so each commit overlaps the steps after it as in a
                # run: saved after the block's last step, its whole commit would sit in the wait below.
                if name == "on" and i % args.every == 0:
                    before = tier.waited_s
                    tier.save(step, b.state)
                    stalls.append(before)
            if name == "on":
                tier.wait()  # what is left of the block's last commit counts in the block's time
            dist.barrier()
            times[name].append((time.perf_counter() - start) / per * 1000)
    # waited_s is cumulative: the stall of snapshot i is the growth between consecutive saves' starts (each save's
    # own time plus its copy's wait, which the next save's wait() adds).
    marks = stalls + [tier.waited_s]
    per_save = [(y - x) * 1000 for x, y in zip(marks, marks[1:])]
    held = sum(p.stat().st_size for p in tier.folder.glob("step-*/__*_0.distcp"))
    spare = sum(p.stat().st_size for p in tier.node.spare.glob("__*_0.distcp"))
    tier.close(remove=True)
    if b.rank == 0:
        off, on = statistics.median(times["off"]), statistics.median(times["on"])
        stall = statistics.median(per_save)
        print(f"{args.size} Llama, 2 gloo ranks x 1 thread as 2 nodes (replica on), {MICRO * b.world} x 128 tokens "
              f"per step, fp32; {args.blocks} blocks of {per} steps per variant, snapshot every {args.every} steps")
        print(f"  off {off:8.1f} ms/step   on {on:8.1f} ms/step   on/off {on / off:5.3f}")
        print(f"  stall per snapshot (save() + the optimizer's wait for the copy): median {stall:.1f} ms = "
              f"{stall / off:.3f} of a step; all: {' '.join(f'{v:.0f}' for v in per_save)} ms")
        print(f"  tier on node n1 at the end: {held / 2**20:.1f} MiB (own shard + replica) and {spare / 2**20:.1f} MiB "
              "of the dropped step's files, kept for the next snapshot")


def run_peak(args: argparse.Namespace, b: Bench) -> None:
    """Each snapshot alone: save + wait (the copy, the write, the replica), the largest rise of RssAnon meanwhile."""
    import gc

    import torch.distributed as dist
    from common import peak_during

    from fsdpjob.orchestrator.core.runfolder.ckptlayout import step_dir_name
    from fsdpjob.orchestrator.core.runfolder.memtier import shard_name

    b.step(1)  # AdamW's moments exist from the first step on
    rises = []
    for n in range(1, args.peak + 1):
        gc.collect()
        dist.barrier()
        rises.append(peak_during("RssAnon", lambda n=n: (b.tier.save(n, b.state), b.tier.wait())))
        dist.barrier()
    saved = (b.tier.folder / step_dir_name(args.peak) / shard_name(b.rank)).stat().st_size
    b.tier.close(remove=True)
    everyone: list[Any] = [None] * b.world
    dist.all_gather_object(everyone, (b.rank, rises, saved))
    if b.rank == 0:
        MiB = 2**20
        print(f"{args.size} Llama, 2 gloo ranks x 1 thread as 2 nodes (replica on), fp32; {args.peak} snapshots, each "
              "alone; the process's own memory (RssAnon, sampled every ms) above its start, largest rise")
        for rank, rises, saved in everyone:
            print(f"  rank {rank}: saved state {saved / MiB:.1f} MiB; first snapshot (the launch's plan) "
                  f"+{rises[0]:.1f} MiB, later ones {' '.join(f'+{r:.1f}' for r in rises[1:])} MiB (plan: 0)")


def run_cpu(args: argparse.Namespace, b: Bench, parts: Any) -> None:
    import torch.distributed as dist

    lines = memory_tier_cpu.measure(b, args.cpu, parts)
    b.tier.close(remove=True)
    everyone: list[Any] = [None] * b.world
    dist.all_gather_object(everyone, lines)
    if b.rank == 0:
        print(f"{args.size} Llama, 2 gloo ranks x 1 thread as 2 nodes (replica on), fp32; {args.cpu} snapshots, each "
              "alone (after a warm-up one); CPU time per snapshot and rank, by part")
        print("\n".join(everyone))


def run(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    parts = memory_tier_cpu.instrument() if args.cpu else None  # before the tier exists: it wraps its parts
    b = setup(args)
    if args.cpu:
        run_cpu(args, b, parts)
    elif args.peak:
        run_peak(args, b)
    else:
        run_ab(args, b)
    dist.barrier()
    dist.destroy_process_group()


def main() -> int:
    args = parse_args()
    if "RANK" not in os.environ:
        return launch(args)
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
