"""The step alone, A/B inside the same two processes: the bare loop's model, optimizer and step against fsdpjob's.

    python bench/step_ab.py [--blocks 10] [--steps-per-block 20] [--ac] [--size 0.1M] [--crossed]

Separate launches (bench/worker_throughput.py) carry the machine's noise: on 2 shared cores one run's rate
differs from the next by 10-20 %, more than the overheads looked for. Here every variant lives in the same 2
gloo ranks (torchrun, one thread each) on the same random Llama and the same token ids, and they take turns in
blocks of steps (the order reversed every other block), so they share the load, the caches and the clock. Each
variant's figure is the median over blocks of milliseconds per step, with its ratio to ``bare``:

- ``bare``: bench/bare_fsdp2.py's loop: from_pretrained on every rank, fully_shard per decoder layer then the
  root, torch's default AdamW (per-tensor on CPU), forward with labels (HF's loss), backward, clip, step,
  ``loss.item()``.
- ``bare-fused``: the same with ``AdamW(fused=True)``, the optimizer fsdpjob runs.
- ``fsdpjob``: the worker's parts: ``jobs.model.load_model`` (meta init, fsdpjob's wrapping, own-shard weight
  read), fused AdamW, ``jobs.step.train_step`` (the global token count from the data, as BatchStream gives
  it), the stop/save flags' FlagAgreement begun and ended around every step as the loop does, and the loss
  read every 10th step as a logged step would.
- with ``--crossed``, also ``fj-model,bare-step`` (fsdpjob's model, the bare step) and ``bare-model,fj-step``
  (the fused bare model, fsdpjob's step): which half a difference comes from.

What it leaves out is the rest of the worker's loop (data stream, metrics, save policy, heartbeat): the
difference between this and worker_throughput's fsdpjob-to-bare ratio is what those cost. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))  # bare_fsdp2, worker_throughput


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=10, help="turns per variant")
    parser.add_argument("--steps-per-block", type=int, default=20)
    parser.add_argument("--ac", action="store_true", help="activation checkpointing in every variant")
    parser.add_argument("--size", default="0.1M", help="a size of bench/worker_throughput.py (0.1M, 19M)")
    parser.add_argument("--crossed", action="store_true", help="also each model with the other's step")
    parser.add_argument("--model", help="(set by the launcher) model folder")
    parser.add_argument("--data", help="(set by the launcher) JSONL text")
    return parser.parse_args(argv)


def launch(args: argparse.Namespace) -> int:
    """Make the assets, then run this file on 2 ranks under torchrun."""
    from common import free_port, make_assets
    from worker_throughput import SIZES

    with tempfile.TemporaryDirectory(prefix="fsdpjob-step-ab-") as tmp:
        model, data = make_assets(Path(tmp), SIZES[args.size])
        torchrun = Path(sys.executable).with_name("torchrun")
        cmd = [str(torchrun), "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
               __file__, "--model", str(model), "--data", str(data), "--blocks", str(args.blocks),
               "--steps-per-block", str(args.steps_per_block), *(["--ac"] if args.ac else []),
               *(["--crossed"] if args.crossed else [])]  # fmt: skip
        return subprocess.run(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), check=False).returncode


def run(args: argparse.Namespace) -> None:
    import bare_fsdp2
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from fsdpjob.jobs.agreement import FlagAgreement
    from fsdpjob.jobs.data import MicroBatch, count_tokens
    from fsdpjob.jobs.dist import DistEnv
    from fsdpjob.jobs.model import FULL, NONE, load_model
    from fsdpjob.jobs.step import train_step

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    micro, per = 4, args.steps_per_block
    rows = bare_fsdp2.packed_rows(args.model, args.data, 128, micro * world * per)
    cpu = torch.device("cpu")

    def fsdpjob_parts():  # the worker's build (jobs/train.py): load_model, then fused AdamW
        env = DistEnv(rank, world, rank, world, "127.0.0.1", 0, "gloo", cpu)
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
        model = load_model(args.model, env=env, mesh=mesh, dtype=torch.float32, attn_implementation="sdpa",
                           mixed_precision="fp32", reshard_after_forward=True,
                           activation_checkpointing=FULL if args.ac else NONE,
                           cpu_offload=False).train()
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.0, fused=True)

    def bare_step(model, optimizer, batch, step):
        bare_fsdp2.train_step(model, optimizer, batch)

    agreement = FlagAgreement(2, None)
    global_tokens = count_tokens(rows[: micro * world])  # every step's: packed rows, no masked label

    def fsdpjob_step(model, optimizer, batch, step):
        agreement.begin(step, (0, 0))
        values = train_step(model, optimizer, [MicroBatch(batch, batch, None, None)], cpu, tokens=global_tokens,
                            max_grad_norm=1.0)
        agreement.end(step)
        if step % 10 == 0:
            values.loss  # noqa: B018 - a logged step's read (one all-reduce)

    variants = {
        "bare": (*bare_fsdp2.build(args.model, activation_checkpointing=args.ac), bare_step),
        "bare-fused": (*bare_fsdp2.build(args.model, activation_checkpointing=args.ac, fused=True), bare_step),
        "fsdpjob": (*fsdpjob_parts(), fsdpjob_step),
    }
    if args.crossed:
        variants["fj-model,bare-step"] = (*fsdpjob_parts(), bare_step)
        variants["bare-model,fj-step"] = (*bare_fsdp2.build(args.model, activation_checkpointing=args.ac, fused=True),
                                          fsdpjob_step)
    times: dict[str, list[float]] = {name: [] for name in variants}
    order = list(variants)
    for block in range(args.blocks):
        for name in order if block % 2 == 0 else order[::-1]:
            model, optimizer, step_fn = variants[name]
            dist.barrier()
            start = time.perf_counter()
            for s in range(per):
                first = s * micro * world + rank * micro
                step_fn(model, optimizer, rows[first : first + micro], block * per + s + 1)
            dist.barrier()
            times[name].append((time.perf_counter() - start) / per * 1000)
    if rank == 0:
        base = statistics.median(times["bare"])
        print(f"{args.size} Llama, 2 gloo ranks x 1 thread, {micro * world} x 128 tokens per step, fp32, "
              f"AC {'on' if args.ac else 'off'}; {args.blocks} blocks of {per} steps per variant, alternating")
        for name, values in times.items():
            mid = statistics.median(values)
            print(f"  {name:<11} {mid:7.2f} ms/step  {base / mid:5.3f}x bare  "
                  f"blocks: {' '.join(f'{v:.1f}' for v in values)}")
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
