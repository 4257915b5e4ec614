"""Peak host memory per rank of the worker at world size 1, 2, 4: the model state (params + grads + AdamW) falls as 1/N.

Run: OMP_NUM_THREADS=1 python bench/memory_scaling.py [--worlds 1 2 4] [--steps 3] [--stock-malloc]

Each world size is a fresh run of jobs.train.run on local gloo ranks (1 thread each) with a random Llama
of about 40 M parameters (vocab 8192, hidden 512, 10 layers), fp32 master weights and compute, seq_len
128, micro batch 1, so that the model state (16 bytes per parameter: fp32 params, grads, AdamW
exp_avg and exp_avg_sq) dominates. Each rank process wraps the worker's train_step (the real one
runs) to read /proc/self/status:

* baseline: VmRSS after importing torch, transformers and the worker, before run();
* pg init: VmRSS growth over init_distributed (gloo's buffers for its peers), shown apart;
* load peak: VmHWM at the first step (process group, meta init, FSDP wrap, weight read);
* train peak: VmHWM over the training steps, after resetting it at the first step
  (/proc/self/clear_refs); this also resets the peak_mem_mb the worker logs;
* model state: bytes of this rank's parameter shards, as much again for the gradient shards
  (freed by zero_grad before the wrapper looks), and the optimizer state tensors.

The ranks run with glibc's mmap threshold frozen at 128 KiB (MALLOC_MMAP_THRESHOLD_=131072, as
bench/plan_accuracy.py does) so freed activations leave the resident set; --stock-malloc measures
with glibc's default instead. The prediction is 16 * parameters / N per rank; the check is that the
measured train peak drops between world sizes by what the prediction drops (ratio near 1).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from common import (
    ModelSize,
    job_spec,
    launch_ranks,
    load_note,
    make_assets,
    proc_status_mib,
    write_run_folder,
)

MIB = 2**20
MEMORY_MODEL = ModelSize(vocab=8192, hidden=512, intermediate=1376, layers=10, heads=8, kv_heads=8)
FROZEN_MMAP_THRESHOLD = "131072"


def _local_bytes(tensor) -> int:
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.numel() * local.element_size()


def _model_state(model, optimizer) -> dict[str, float]:
    import torch

    params = sum(_local_bytes(p) for p in model.parameters())
    optim = sum(_local_bytes(t) for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t))
    return {"params_mib": params / MIB, "grads_mib": params / MIB, "optim_mib": optim / MIB,
            "params_total": sum(p.numel() for p in model.parameters())}  # fmt: skip


def rank_main(run_dir: Path, out: Path) -> None:
    """One worker rank: run the real worker, sampling memory around its training steps."""
    import torch
    from transformers import AutoModelForCausalLM  # noqa: F401 - in the baseline, as the worker will import it

    from fsdpjob.jobs import train

    torch.set_num_threads(1)
    sample: dict[str, float] = {"baseline_mib": proc_status_mib("VmRSS")}
    real_step, real_init = train.train_step, train.init_distributed

    def measured_init(*args, **kwargs):
        env = real_init(*args, **kwargs)
        sample["pg_init_mib"] = proc_status_mib("VmRSS") - sample["baseline_mib"]
        return env

    def measured_step(model, optimizer, *args, **kwargs):
        if "load_peak_mib" not in sample:
            sample["load_peak_mib"] = proc_status_mib("VmHWM")
            Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS: the train peak starts here
        result = real_step(model, optimizer, *args, **kwargs)
        sample["train_peak_mib"] = proc_status_mib("VmHWM")
        sample.update(_model_state(model, optimizer))
        return result

    train.train_step, train.init_distributed = measured_step, measured_init
    started = time.time()
    train.run(str(run_dir))
    sample["run_s"] = time.time() - started
    out.write_text(json.dumps(sample), encoding="utf-8")


def measure(root: Path, spec: dict, world: int, stock_malloc: bool) -> list[dict]:
    run_dir = write_run_folder(root / f"world{world}", spec)
    env = {} if stock_malloc else {"MALLOC_MMAP_THRESHOLD_": FROZEN_MMAP_THRESHOLD}
    launch_ranks([__file__, "--rank", str(run_dir)], world, run_dir / "logs", env=env)
    return [json.loads((run_dir / f"memory-rank{r}.json").read_text()) for r in range(world)]


def report(results: dict[int, list[dict]]) -> None:
    params = results[min(results)][0]["params_total"]
    predicted = {n: 16 * params / n / MIB for n in results}
    print(f"model {params / 1e6:.1f} M parameters: model state 16 B/param = {16 * params / MIB:.0f} MiB in all; "
          "MiB per rank")
    print(f"{'N':>2} {'predicted':>9} {'measured':>9} {'train peak':>10} {'peak-state':>10} {'load peak':>15} "
          f"{'pg init':>7} {'baseline':>8} {'run s':>6}")  # fmt: skip
    print(f"{'':>2} {'state/rank':>9} {'state/rank':>9} {'above base':>10} {'(the rest)':>10} {'r0 / others':>15}")
    peaks = {}
    for n, ranks in results.items():
        state = max(r["params_mib"] + r["grads_mib"] + r["optim_mib"] for r in ranks)
        peaks[n] = max(r["train_peak_mib"] - r["baseline_mib"] for r in ranks)
        load = [r["load_peak_mib"] - r["baseline_mib"] for r in ranks]
        others = f"{max(load[1:]):.0f}" if len(load) > 1 else "-"
        print(f"{n:>2} {predicted[n]:>9.0f} {state:>9.0f} {peaks[n]:>10.0f} {peaks[n] - state:>10.0f} "
              f"{load[0]:>7.0f} / {others:<5} {max(r['pg_init_mib'] for r in ranks):>7.1f} "
              f"{statistics.mean(r['baseline_mib'] for r in ranks):>8.0f} "
              f"{max(r['run_s'] for r in ranks):>6.0f}")  # fmt: skip
    worlds = sorted(results)
    for a, b in zip(worlds, worlds[1:]):
        drop, expected = peaks[a] - peaks[b], predicted[a] - predicted[b]
        print(f"train peak drop N={a}->{b}: measured {drop:.0f} MiB, predicted (model state) {expected:.0f} MiB, "
              f"ratio {drop / expected:.2f}")  # fmt: skip
    print(f"train peak ratio N={worlds[0]}/N={worlds[-1]}: {peaks[worlds[0]] / peaks[worlds[-1]]:.2f} "
          f"(model state alone: {worlds[-1] / worlds[0]:.0f})")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--stock-malloc", action="store_true", help="keep glibc's default (dynamic) mmap threshold")
    parser.add_argument("--rank", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank:
        rank = int(os.environ["RANK"])
        rank_main(args.rank, args.rank / f"memory-rank{rank}.json")
        return
    print(load_note(), flush=True)
    with tempfile.TemporaryDirectory(prefix="fsdpjob-memory-") as tmp:
        root = Path(tmp)
        model, data = make_assets(root, MEMORY_MODEL)
        spec = job_spec("memory", model, data, seq_len=128, micro_batch=1, max_steps=args.steps,
                        fsdp={"mixed_precision": "fp32"})  # fmt: skip
        results = {}
        for world in args.worlds:
            results[world] = measure(root, spec, world, args.stock_malloc)
            print(f"world {world} done; {load_note()}", flush=True)
    report(results)


if __name__ == "__main__":
    sys.exit(main())
