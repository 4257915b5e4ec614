"""Loading a model into FSDP2: each rank reading its own shards (the worker's default) against rank 0 reading
everything and broadcasting (FSDPJOB_WEIGHT_LOAD=rank0), in the same run: wall time and peak host RAM per rank.

Run: OMP_NUM_THREADS=1 python bench/weight_load.py [--ranks 2 4] [--storage fp32 bf16] [--rounds 2] [--warm]
     [--layers 24] [--workdir DIR]
Builds a random Llama (374M parameters with the defaults: 1.5 GB in fp32) saved with save_pretrained
(safetensors) in fp32 and in bf16, then loads it into fp32 FSDP2 shards with ``jobs.model.load_model`` (meta
init, fully_shard, materialize, weights), each load in fresh rank processes, the two methods alternating. The
file is evicted from the page cache before each load (a job's first start reads from disk); --warm leaves it
cached. Peak host RAM is VmHWM (resident: anonymous memory and mapped file pages) above the baseline after
imports and process-group setup; ratios are over the fp32 model's bytes. ``overhead`` subtracts the rank's own
fp32 shard, which it keeps for training whatever the method.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from common import evict_from_page_cache
from load_memory import MIB, _make_models, _run, _status_mib

METHODS = ("rank0", "sharded")


def _worker(method: str, model_dir: str) -> None:
    import torch

    from fsdpjob.jobs.dist import close_distributed, init_distributed
    from fsdpjob.jobs.model import NONE, load_model
    from fsdpjob.jobs.model.parallelize import build_mesh

    os.environ["FSDPJOB_WEIGHT_LOAD"] = method
    torch.set_num_threads(1)
    env = init_distributed(600)
    mesh = build_mesh(env, 1)
    torch.distributed.barrier()
    baseline = _status_mib("VmHWM")
    start = time.perf_counter()
    model = load_model(
        model_dir, env=env, mesh=mesh, dtype=torch.float32, attn_implementation="sdpa", mixed_precision="fp32",
        reshard_after_forward=True, activation_checkpointing=NONE, cpu_offload=False,
    )  # fmt: skip
    torch.distributed.barrier()
    seconds = time.perf_counter() - start
    shard = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    result = dict(
        rank=env.rank, baseline_mib=baseline, peak_mib=_status_mib("VmHWM"), seconds=seconds, shard_mib=shard / MIB,
        fp32_model_mib=sum(p.numel() for p in model.parameters()) * 4 / MIB,
    )  # fmt: skip
    close_distributed()
    print("RESULT " + json.dumps(result), flush=True)


def _summary(runs: list[list[dict]]) -> dict[str, float]:
    """Medians over rounds: wall time (slowest rank), rank 0 and the worst other rank above baseline / overhead."""
    model = runs[0][0]["fp32_model_mib"]

    def med(values: list[float]) -> float:
        return statistics.median(values)

    above = [[r["peak_mib"] - r["baseline_mib"] for r in run] for run in runs]
    over = [[r["peak_mib"] - r["baseline_mib"] - r["shard_mib"] for r in run] for run in runs]
    return {
        "seconds": med([max(r["seconds"] for r in run) for run in runs]),
        "rank0_above": med([a[0] for a in above]) / model,
        "others_above": med([max(a[1:]) for a in above]) / model,
        "rank0_overhead": med([o[0] for o in over]) / model,
        "others_overhead": med([max(o[1:]) for o in over]) / model,
        "model_mib": model,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--storage", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    parser.add_argument("--rounds", type=int, default=2, help="loads per method and case (medians are printed)")
    parser.add_argument("--warm", action="store_true", help="leave the weights in the page cache between loads")
    parser.add_argument("--layers", type=int, default=24, help="decoder layers (24 gives about 374M parameters)")
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "fsdpjob_load_memory")
    parser.add_argument("--json", type=Path, help="also write every run's figures here")
    parser.add_argument("--worker", nargs=2, metavar=("METHOD", "MODEL_DIR"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker(*args.worker)
        return
    dirs = _make_models(args.workdir, args.layers)
    print(f"load average before: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; page cache "
          f"{'warm' if args.warm else 'evicted before each load'}", flush=True)  # fmt: skip
    raw: dict[str, list] = {}
    rows = []
    for ranks in args.ranks:
        for storage in args.storage:
            runs: dict[str, list] = {m: [] for m in METHODS}
            for round_ in range(args.rounds):  # A B, then B A: neither method always meets the other's leftovers
                for method in METHODS if round_ % 2 == 0 else METHODS[::-1]:
                    if not args.warm:
                        evict_from_page_cache(dirs[storage].glob("*.safetensors"))
                    runs[method].append(_run(method, dirs[storage], ranks, script=__file__))
            for method in METHODS:
                raw[f"{ranks}/{storage}/{method}"] = runs[method]
                rows.append((ranks, storage, method, _summary(runs[method])))
    model = rows[0][3]["model_mib"]
    print(f"\nfp32 model: {model:.0f} MiB; peaks are VmHWM above the baseline, over the fp32 model; "
          f"overhead = above - own fp32 shard; medians of {args.rounds}")  # fmt: skip
    print(f"{'ranks':>5} {'file':5} {'method':8} {'load s':>7} {'rank0 peak':>10} {'others peak':>11} "
          f"{'rank0 ovh':>9} {'others ovh':>10}")  # fmt: skip
    for ranks, storage, method, s in rows:
        print(f"{ranks:>5} {storage:5} {method:8} {s['seconds']:7.2f} {s['rank0_above']:10.2f} "
              f"{s['others_above']:11.2f} {s['rank0_overhead']:9.2f} {s['others_overhead']:10.2f}")  # fmt: skip
    print(f"load average after: {os.getloadavg()[0]:.1f}")
    if args.json:
        args.json.write_text(json.dumps(raw, indent=1))


if __name__ == "__main__":
    main()
