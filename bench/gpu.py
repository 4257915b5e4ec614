"""GPU benchmark: the real fsdpjob worker on one NVIDIA GPU against a bare FSDP2 loop, ~1.2B Llama shape, bf16.

    bench/gpu                      # installs what is missing (offline-safe), then runs every case below
    python bench/gpu.py            # the cases, 40 steps each (fewer for the save and offload cases)
    python bench/gpu.py --tiny     # the same cases on CPU with a tiny model (checks the script itself; CI)
    python bench/gpu.py --cases bare fsdpjob --out DIR

Builds the model (random init, save_pretrained), a tokenizer and a synthetic data set locally (no downloads),
then runs each case in its own process, one after the other, on the same model, data, batch and precision
(bf16 parameters, fp32 gradient reduction, fp32 master weights, activation checkpointing, fused AdamW).
A failing case is recorded (its JSON says why) and the others still run. No case writes a final checkpoint
(FSDPJOB_SKIP_FINAL_SAVE=1):

- ``bare``: bench/bare_fsdp2.py under torchrun (1 process): from_pretrained, fully_shard per decoder layer
  then the root, a plain loop that reads its loss every step;
- ``fsdpjob``: the worker (`fsdpjob.jobs.train.run`) as a world-size-1 FSDP2 job, data read in order;
- ``fsdpjob-compile``: the same with ``model.compile: true`` (torch.compile of each decoder block);
- ``fsdpjob-packing``: the worker with boundary-aware packing (``data.packing: true``: whole examples per row,
  each attending to itself only), against the naive rows of the other cases;
- ``save-sync`` / ``save-async``: one checkpoint mid-run, written synchronously / with checkpoint.async_save;
- ``offload``: fsdp.cpu_offload (a few steps: the host-side AdamW is slow).

Writes one JSON per case into --out and prints a table: tokens/s over the steps after the warm-up (step-end
time stamps), the ratio to the bare loop, MFU (the worker's formula: 6N + the attention term, against the
device's dense bf16 peak), peak allocated / reserved / device-used memory, the planner's peak for the same
spec and its error against the reserved peak, device-used minus reserved (what the plan's assumed CUDA runtime item
stands for: context, cuBLAS, NCCL), start-up seconds, the first step's seconds (compile included), the save's
seconds in the loop and what it blocked (an async save: the call plus the next step's wait at the staging gate),
the checkpoint's load seconds (save-sync runs again and resumes from its mid-run checkpoint), and the SDPA
backends this torch can run for the shape (a probe, not a trace).
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
CASES = ("bare", "fsdpjob", "fsdpjob-compile", "fsdpjob-packing", "save-sync", "save-async", "offload")
# The spec changes of each worker case, over the plain fsdpjob one.
WORKER_CASES = {
    "fsdpjob": {},
    "fsdpjob-compile": {"model": {"compile": True}},
    "save-sync": {"checkpoint": {"async_save": False}},
    "save-async": {"checkpoint": {"async_save": True}},
    "offload": {"fsdp": {"cpu_offload": True}},
    "fsdpjob-packing": {"data": {"packing": True}},  # boundary-aware: whole examples, per-example attention
}
LR = 1e-4  # constant in every case


def build_assets(root: Path, tiny: bool) -> tuple[str, str]:
    from fsdpjob.jobs.quickstart import build_tiny_model, build_tokenizer

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
    subprocess.run(cmd, check=True, stdout=sys.stderr, timeout=args.case_timeout)
    record = json.loads(out.read_text())
    return {"ends": dict(enumerate(record["times"])), "losses": record["losses"],
            "peak_mem_mb": record["info"].get("peak_mem_mb")}  # fmt: skip



def _merge(base: dict, extra: dict) -> dict:
    return {**base, **{k: {**base.get(k, {}), **v} for k, v in extra.items()}}


def worker_spec(case: str, model: str, data: str, args: argparse.Namespace, steps: int) -> dict:
    base = {
        "name": case,
        "model": {"path": model, "activation_checkpointing": True},
        "data": {"path": data, "seq_len": args.seq, "shuffle": False, "packing": "naive"},  # the bare loop's rows
        "train": {"max_steps": steps, "micro_batch_size": args.micro_batch, "lr": LR, "lr_schedule": "constant",
                  "log_every": 1},  # the bare loop reads its loss every step too
        "fsdp": {"mixed_precision": "bf16"},
        "checkpoint": {"interval_steps": steps // 2 if case.startswith("save-") else 0, "interval_minutes": 0},
    }  # fmt: skip
    return _merge(base, WORKER_CASES[case])


def run_fsdpjob(root: Path, model: str, data: str, args: argparse.Namespace, case: str, steps: int) -> dict:
    from fsdpjob.orchestrator.core.spec import JobSpec

    spec = JobSpec.model_validate(worker_spec(case, model, data, args, steps))
    run_dir = root / case
    run_dir.mkdir()
    from fsdpjob.orchestrator.core.paths import RunPaths
    from fsdpjob.orchestrator.core.runmeta import RunMeta

    RunMeta.of(spec).write(RunPaths(run_dir))
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port), RANK="0", WORLD_SIZE="1",
               LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", FSDPJOB_SKIP_FINAL_SAVE="1")  # fmt: skip
    code = "import sys; from fsdpjob.jobs.train import run; run(sys.argv[1])"
    subprocess.run([sys.executable, "-c", code, str(run_dir)], check=True, env=env, stdout=sys.stderr,
                   timeout=args.case_timeout)
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    events = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]
    load_s = None
    if case == "save-sync":
        # The same run again: it resumes from its mid-run checkpoint (no final save was written); the resume
        # event's load_s is the checkpoint's load, timed by the worker.
        subprocess.run([sys.executable, "-c", code, str(run_dir)], check=True, env=env, stdout=sys.stderr,
                       timeout=args.case_timeout)
        resumed = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]
        load_s = next((e.get("load_s") for e in resumed if e.get("event") == "resume"), None)
    steps_logged = [m for m in metrics if "loss" in m]
    ready = next(e for e in events if e.get("event") == "ready")
    saves = [e["save_s"] for e in events if e.get("event") == "checkpoint"]
    # What an async save still cost the loop: its time in the save call plus the next step's wait at the
    # staging gate (the optimizer may not change what the background copy still reads).
    gate = [e["waited_s"] for e in events if e.get("event") == "staged"]
    def peak(key: str) -> float | None:
        return max((m[key] for m in steps_logged if m.get(key) is not None), default=None)

    return {"ends": {m["step"]: m["time"] for m in steps_logged},
            "targets": {m["step"]: m.get("tokens") for m in steps_logged}, "losses": [m["loss"] for m in steps_logged],
            "peak_mem_mb": peak("peak_mem_mb"), "peak_reserved_mb": peak("peak_reserved_mb"),
            "device_used_mb": peak("device_used_mb"), "mfu_worker": [m["mfu"] for m in steps_logged],
            "startup_s": ready.get("setup_s"), "first_step_s": steps_logged[0]["time"] - ready["time"],
            "save_s": saves[0] if saves else None, "gate_wait_s": gate[0] if gate else None,
            "blocking_s": saves[0] + (gate[0] if gate else 0.0) if saves else None, "load_s": load_s,
            "runtime_mb": _minus(peak("device_used_mb"), peak("peak_reserved_mb")),
            "planned_peak_mb": planned_peak_mb(spec, args)}  # fmt: skip


def _minus(a: float | None, b: float | None) -> float | None:
    """Device-used minus reserved: the CUDA context, cuBLAS and NCCL memory the plan's runtime item assumes."""
    return None if a is None or b is None else a - b


def planned_peak_mb(spec, args: argparse.Namespace) -> float | None:
    """The planner's per-rank peak for this spec on this machine (one GPU, or the CPU)."""
    import torch

    from fsdpjob.orchestrator.core.profiles import ClusterProfile
    from fsdpjob.orchestrator.planner.fit import make_plan
    from fsdpjob.orchestrator.planner.resolve import resolve

    gpu = torch.cuda.is_available() and not args.tiny
    fields = {"name": "bench", "scheduler": "slurm", "gpus_per_node": int(gpu), "host_ram_gb": 64.0,
              "cpus_per_node": os.cpu_count() or 1}  # fmt: skip
    if gpu:
        usable = torch.cuda.get_device_properties(0).total_memory / 2**30  # what torch can allocate
        fields.update(gpu_type=torch.cuda.get_device_name(0), gpu_memory_gb=usable, gpu_usable_memory_gb=usable)
    try:
        plan = make_plan(resolve(spec, ClusterProfile.model_validate(fields)))
    except Exception as exc:  # a figure of the table, not the bench's result
        print(f"planner: {type(exc).__name__}: {exc}", file=sys.stderr)
        return None
    return plan.device.peak / 2**20


def sdpa_backends(seq: int) -> str:
    """Which SDPA kernels accept this shape in bf16 on this device (each tried alone): a probe of what can run."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if not torch.cuda.is_available():
        return "cpu"
    q = torch.randn(1, 16, seq, 128, device="cuda", dtype=torch.bfloat16)
    ok = []
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION):
        try:
            with sdpa_kernel([backend]):
                F.scaled_dot_product_attention(q, q, q, is_causal=True)
            ok.append(backend.name.lower())
        except RuntimeError:
            pass
    return "+".join(ok) or "math only"


def run_case(case: str, root: Path, model: str, data: str, args: argparse.Namespace) -> dict:
    """One case in its own process(es); a failure is recorded, not raised."""
    steps = args.steps if case in ("bare", "fsdpjob", "fsdpjob-compile") else min(args.steps, args.short_steps)
    started = time.time()
    try:
        r = run_bare(root, model, data, args) if case == "bare" else run_fsdpjob(root, model, data, args, case, steps)
    except Exception as exc:  # one failing case is recorded and the others still run
        return {"case": case, "error": f"{type(exc).__name__}: {exc}"[:2000], "wall_s": time.time() - started}
    ends, warmup = r["ends"], min(args.warmup, steps - 1)
    r["rate"] = (steps - warmup) * args.micro_batch * args.seq / (ends[steps] - ends[warmup]) if warmup else None
    # Real (target) tokens/s from the worker's own cumulative count: what packing with padding is judged on.
    targets = r.get("targets") or {}
    if warmup and targets.get(steps) is not None and targets.get(warmup) is not None:
        r["target_rate"] = (targets[steps] - targets[warmup]) / (ends[steps] - ends[warmup])
    return {"case": case, "steps": steps, "wall_s": time.time() - started, **r}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="tiny model on CPU: checks the script, not the GPU")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--short-steps", type=int, default=8, help="steps of the save and offload cases")
    parser.add_argument("--warmup", type=int, default=10, help="first steps left out of tokens/s")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES))
    parser.add_argument("--port", type=int, default=29533)
    parser.add_argument("--case-timeout", type=float, default=240.0, help="seconds before a case is given up")
    parser.add_argument("--out", type=Path, default=Path("gpu-bench"), help="folder for one JSON per case")
    args = parser.parse_args()
    import torch

    from fsdpjob.jobs.metrics import mfu

    if not args.tiny and not torch.cuda.is_available():
        sys.exit("no CUDA device: run on a GPU machine, or pass --tiny to check the script on CPU")
    if args.tiny:
        args.steps, args.warmup, args.short_steps = min(args.steps, 8), min(args.warmup, 3), min(args.short_steps, 4)
    args.seq = 128 if args.tiny else args.seq_len
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    args.out.mkdir(parents=True, exist_ok=True)
    results = {}
    with tempfile.TemporaryDirectory(prefix="fsdpjob-gpu-") as tmp:
        root = Path(tmp)
        t0 = time.time()
        model, data = build_assets(root, args.tiny)
        from transformers import AutoConfig

        from fsdpjob.jobs.metrics import model_flops_per_token

        flops_per_token = model_flops_per_token(AutoConfig.from_pretrained(model), seq_len=args.seq)
        print(f"assets            {time.time() - t0:.0f} s", flush=True)
        for case in args.cases:
            r = run_case(case, root, model, data, args)
            (args.out / f"{case}.json").write_text(json.dumps(r, indent=1, default=str) + "\n")
            results[case] = r
            print(f"{case:<17} {_status(r)}", flush=True)

    name = torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu"
    shape = "tiny" if args.tiny else "2048 x 24 layers (~1.2B params)"
    print(f"\ndevice   {name}, torch {torch.__version__}; SDPA kernels for the shape: {sdpa_backends(args.seq)}")
    print(f"model    llama {shape}, bf16 mixed precision, activation checkpointing, fused AdamW")
    print(f"batch    {args.micro_batch} x {args.seq} tokens per step; steps after {args.warmup} timed; JSON in {args.out}")
    base = results.get("bare", {}).get("rate")
    print("\n| case | tok/s | / bare | MFU | peak alloc / reserved / device MiB | device - reserved MiB "
          "| planned MiB (error vs reserved) | start-up s | first step s | save s (blocking) | load s "
          "| loss first -> last |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for case, r in results.items():
        if "rate" not in r:
            print(f"| {case} | {_status(r)} |||||||||||")
            continue
        rate = r["rate"]
        ratio = f"{rate / base:.2f}" if base and rate else "-"
        util = mfu(flops_per_token, rate, 1.0, device, 1) if rate else None
        measured = r.get("peak_reserved_mb") or r.get("peak_mem_mb")
        planned = r.get("planned_peak_mb")
        error = f" ({planned / measured - 1:+.0%})" if planned and measured else ""
        mem = " / ".join(_num(r.get(k)) for k in ("peak_mem_mb", "peak_reserved_mb", "device_used_mb"))
        save = f"{_num(r.get('save_s'), '.2f')} ({_num(r.get('blocking_s'), '.2f')})"
        print(f"| {case} | {_num(rate)} | {ratio} | {_num(util, '.3f')} | {mem} | {_num(r.get('runtime_mb'))} "
              f"| {_num(planned)}{error} | {_num(r.get('startup_s'), '.1f')} | {_num(r.get('first_step_s'), '.1f')} "
              f"| {save} | {_num(r.get('load_s'), '.2f')} | {r['losses'][0]:.4f} -> {r['losses'][-1]:.4f} |")


def _num(value: float | None, fmt: str = ".0f") -> str:
    return "-" if value is None else format(value, fmt)


def _status(r: dict) -> str:
    if "error" in r:
        return f"FAILED: {r['error'].splitlines()[0][:200]}"
    real = f" ({_num(r['target_rate'])} target tok/s)" if r.get("target_rate") else ""
    return f"{_num(r['rate'])} tok/s{real}, {r['wall_s']:.0f} s"


if __name__ == "__main__":
    main()
