"""GPU benchmark: the real fsdpjob worker on one NVIDIA GPU against a bare FSDP2 loop, ~1.2B Llama shape, bf16.

    bench/gpu --prepare .whl --python 3.12      # here (PyPI): the wheels a bare GPU machine lacks
    bench/gpu --offline .whl --group 1 --out $OUT   # there (no network): bare, fsdpjob, save-async
    bench/gpu --offline .whl --group 2 --out $OUT   # fsdpjob-compile, offload, save-sync
    python bench/gpu.py --tiny [--group N]     # the same cases on CPU with a tiny model (checks the script; CI)
    python bench/gpu.py --cases bare fsdpjob --out DIR

Builds the model (random init, save_pretrained), a tokenizer and a synthetic data set locally (no downloads),
probes the device in a process of its own (bench/gpu_probe.py: name, nominal bf16 peak, a measured bf16 matmul
peak, SDPA kernels), then runs each case in its own process, one after the other, on the same model, data, batch
and precision (bf16 parameters, fp32 gradient reduction, fp32 master weights, activation checkpointing, fused
AdamW), with the GPU profiles' allocator setting (expandable segments). A failing case is recorded (its JSON says
why) and the others still run. No case writes a final checkpoint (FSDPJOB_SKIP_FINAL_SAVE=1). Each case is timed
over at least 10 steps after its warm-up. The two groups each fit one device call of 8 minutes on an H200:

- ``bare`` (group 1): bench/bare_fsdp2.py under torchrun (1 process): from_pretrained, fully_shard per decoder
  layer then the root, a plain loop that reads its loss every step, on naive rows (concatenate and cut);
- ``fsdpjob`` (1): the worker (`fsdpjob.jobs.train.run`, via bench/gpu_worker.py) as a world-size-1 FSDP2 job on
  the default spec: boundary-aware packing (whole examples per row, each attending to itself), the default
  attention; data read in order. Every other worker case is this spec with one change;
- ``save-async`` (1) / ``save-sync`` (2): one checkpoint mid-run, with checkpoint.async_save / written
  synchronously (save-sync then runs again and resumes from it: the load's seconds);
- ``fsdpjob-compile`` (2): ``model.compile: true`` (torch.compile of each decoder block), with dynamo's counters;
- ``offload`` (2): fsdp.cpu_offload (the host-side AdamW is slow: the short step count, 13 with 3 untimed, as the
  save cases);
- ``fsdpjob-naive`` (no group): the worker on the bare loop's naive rows, like for like with ``bare``.

Writes one JSON per case into --out, and results-groupN.json (every case, the probe, the settings) and
table-groupN.txt (results.json and table.txt without --group), flat, as the device tool fetches them. The table:
tokens/s after the warm-up (step-end time stamps; the real target tokens/s beside it), the ratio to the bare
loop, MFU (the worker's formula: 6N + the attention term) against the card's nominal dense bf16 peak and against
the measured matmul peak, peak allocated / reserved / device-used memory, the planner's peak less its CUDA
runtime item against the reserved peak and the whole plan against device-used (review N6: reserved holds no
runtime), device-used minus reserved (what the runtime item stands for; at world size 1 NCCL holds ~nothing),
the case process's host VmHWM against the planner's host peak, start-up seconds, the first step's seconds
(compile included), the save's seconds in the loop and what it blocked (an async save: the call plus the next
step's wait at the staging gate), the checkpoint's load seconds, and dynamo's graphs / recompiles / graph breaks.
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

from gpu_table import LONG_CASES, render_table  # bench/ is this script's folder: on sys.path

HERE = Path(__file__).resolve().parent
GROUPS = {1: ("bare", "fsdpjob", "save-async"), 2: ("fsdpjob-compile", "offload", "save-sync")}
CASES = (*GROUPS[1], *GROUPS[2], "fsdpjob-naive", "fsdpjob-sdpa")
# The spec changes of each worker case, over the default one (fsdpjob).
WORKER_CASES = {
    "fsdpjob": {},
    "fsdpjob-naive": {"data": {"packing": "naive"}},  # the bare loop's rows: like for like
    "fsdpjob-sdpa": {"model": {"attn_implementation": "sdpa"}},  # packed rows through transformers' dense mask
    "fsdpjob-compile": {"model": {"compile": True}},
    "save-sync": {"checkpoint": {"async_save": False}},
    "save-async": {"checkpoint": {"async_save": True}},
    "offload": {"fsdp": {"cpu_offload": True}},
}
LR = 1e-4  # constant in every case
MIN_TIMED = 10  # steps after the warm-up each case is timed over
# What the GPU cluster profiles set (cluster_profiles/h200.yaml): the planner's fragmentation allowance assumes it.
ALLOC_CONF = "expandable_segments:True"


def build_assets(root: Path, tiny: bool) -> tuple[str, str]:
    from fsdpjob.jobs.quickstart import build_tiny_model, build_tokenizer

    rng = random.Random(0)
    words = ["alpha", "beta", "gamma", "delta", "tensor", "shard", "gather", "reduce", "token", "layer"]
    # Examples of varied length (about 70-1100 tokens at the full size, a quarter of seq_len on average), so that
    # boundary packing puts several whole examples in a row, as real data does.
    most = 40 if tiny else 300
    lines = [" ".join(rng.choice(words) + str(rng.randrange(1000)) for _ in range(rng.randint(most // 15, most)))
             for _ in range(1500)]  # fmt: skip
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


def case_env(args: argparse.Namespace) -> dict[str, str]:
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port), RANK="0", WORLD_SIZE="1",
               LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", FSDPJOB_SKIP_FINAL_SAVE="1")  # fmt: skip
    if not args.tiny:
        env.setdefault("PYTORCH_CUDA_ALLOC_CONF", ALLOC_CONF)
    return env


def run_bare(root: Path, model: str, data: str, args: argparse.Namespace, steps: int) -> dict:
    out = root / "bare.json"
    device = ["--device", "cpu"] if args.tiny else ["--device", "cuda"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "--master-port", str(args.port),
           str(HERE / "bare_fsdp2.py"), "--model", model, "--data", data, "--seq-len", str(args.seq),
           "--micro-batch", str(args.micro_batch), "--steps", str(steps), "--lr", str(LR),
           "--activation-checkpointing", "--bf16", *device, "--out", str(out)]  # fmt: skip
    subprocess.run(cmd, check=True, stdout=sys.stderr, timeout=args.case_timeout, env=case_env(args))
    record = json.loads(out.read_text())
    info = record["info"]
    return {"ends": dict(enumerate(record["times"])), "losses": record["losses"],
            **{k: info.get(k) for k in ("peak_mem_mb", "peak_reserved_mb", "device_used_mb", "vmhwm_mb")},
            "runtime_mb": _minus(info.get("device_used_mb"), info.get("peak_reserved_mb"))}  # fmt: skip


def _merge(base: dict, extra: dict) -> dict:
    return {**base, **{k: {**base.get(k, {}), **v} for k, v in extra.items()}}


def worker_spec(case: str, model: str, data: str, args: argparse.Namespace, steps: int) -> dict:
    base = {
        "name": case,
        "model": {"path": model, "activation_checkpointing": True},  # the default attention
        "data": {"path": data, "seq_len": args.seq, "shuffle": False},  # the default packing: boundary-aware
        "train": {"max_steps": steps, "micro_batch_size": args.micro_batch, "lr": LR, "lr_schedule": "constant",
                  "log_every": 1},  # the bare loop reads its loss every step too
        "fsdp": {"mixed_precision": "bf16"},
        "checkpoint": {"interval_steps": steps // 2 if case.startswith("save-") else 0, "interval_minutes": 0},
    }  # fmt: skip
    return _merge(base, WORKER_CASES[case])


def _worker(run_dir: Path, args: argparse.Namespace, launch: int) -> dict:
    """One launch of the worker on ``run_dir`` (bench/gpu_worker.py): its VmHWM and dynamo's counters."""
    out = run_dir / f"process-{launch}.json"
    cmd = [sys.executable, str(HERE / "gpu_worker.py"), str(run_dir), str(out)]
    cmd += ["--backend", "aot_eager"] if args.tiny else []  # inductor's C++ builds take minutes on a CPU runner
    subprocess.run(cmd, check=True, env=case_env(args), stdout=sys.stderr, timeout=args.case_timeout)
    return json.loads(out.read_text())


def run_fsdpjob(root: Path, model: str, data: str, args: argparse.Namespace, case: str, steps: int) -> dict:
    from fsdpjob.orchestrator.core.jobspec.spec import JobSpec
    from fsdpjob.orchestrator.core.runfolder.paths import RunPaths
    from fsdpjob.orchestrator.core.runfolder.runmeta import RunMeta

    spec = JobSpec.model_validate(worker_spec(case, model, data, args, steps))
    run_dir = root / case
    run_dir.mkdir()
    RunMeta.of(spec).write(RunPaths(run_dir))
    process = _worker(run_dir, args, 0)
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    events = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]
    load_s = None
    if case == "save-sync":
        # The same run again: it resumes from its mid-run checkpoint (no final save was written); the resume
        # event's load_s is the checkpoint's load, timed by the worker.
        resumed = _worker(run_dir, args, 1)
        process["vmhwm_mb"] = max(filter(None, [process.get("vmhwm_mb"), resumed.get("vmhwm_mb")]), default=None)
        events_now = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]
        load_s = next((e.get("load_s") for e in events_now if e.get("event") == "resume"), None)
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
            "vmhwm_mb": process.get("vmhwm_mb"), "dynamo": process.get("dynamo"),
            **plan_figures(spec, args)}  # fmt: skip


def _minus(a: float | None, b: float | None) -> float | None:
    """Device-used minus reserved: the CUDA context, cuBLAS and NCCL memory the plan's runtime item assumes."""
    return None if a is None or b is None else a - b


def plan_figures(spec, args: argparse.Namespace) -> dict[str, float | None]:
    """The planner's per-rank device peak, its CUDA runtime item and its host peak for this spec on this machine
    (one GPU as the probe saw it, or the CPU)."""
    from fsdpjob.orchestrator.core.jobspec.profiles import ClusterProfile
    from fsdpjob.orchestrator.planner.fit import make_plan
    from fsdpjob.orchestrator.planner.resolve import resolve

    gpu = args.probe["device"] == "cuda"
    fields = {"name": "bench", "scheduler": "slurm", "gpus_per_node": int(gpu), "host_ram_gb": 64.0,
              "cpus_per_node": os.cpu_count() or 1}  # fmt: skip
    if gpu:
        usable = args.probe["total_memory_gib"]  # what torch can allocate
        fields.update(gpu_type=args.probe["name"], gpu_memory_gb=usable, gpu_usable_memory_gb=usable)
    try:
        plan = make_plan(resolve(spec, ClusterProfile.model_validate(fields)))
    except Exception as exc:  # figures of the table, not the bench's result
        print(f"planner: {type(exc).__name__}: {exc}", file=sys.stderr)
        return {"planned_peak_mb": None, "planned_runtime_mb": None, "planned_host_mb": None}
    return {"planned_peak_mb": plan.device.peak / 2**20, "planned_runtime_mb": plan.device.runtime.bytes / 2**20,
            "planned_host_mb": plan.host.peak / 2**20}  # fmt: skip


def run_case(case: str, root: Path, model: str, data: str, args: argparse.Namespace) -> dict:
    """One case in its own process(es); a failure is recorded, not raised."""
    steps, warmup = (args.steps, args.warmup) if case in LONG_CASES else (args.short_steps, args.short_warmup)
    started = time.time()
    try:
        r = run_bare(root, model, data, args, steps) if case == "bare" else run_fsdpjob(root, model, data, args, case,
                                                                                      steps)  # fmt: skip
    except Exception as exc:  # one failing case is recorded and the others still run
        return {"case": case, "error": f"{type(exc).__name__}: {exc}"[:2000], "wall_s": time.time() - started}
    ends = r["ends"]
    seconds = ends[steps] - ends[warmup]
    r["rate"] = (steps - warmup) * args.micro_batch * args.seq / seconds
    # Real (target) tokens/s from the worker's own cumulative count: what packing with padding is judged on.
    targets = r.get("targets") or {}
    if targets.get(steps) is not None and targets.get(warmup) is not None:
        r["target_rate"] = (targets[steps] - targets[warmup]) / seconds
    achieved = args.flops_per_token * r["rate"]
    r["achieved_tflops"] = achieved / 1e12
    r["mfu_nominal"] = achieved / args.probe["nominal_flops"] if args.probe["nominal_flops"] else None
    r["mfu_measured"] = achieved / args.probe["matmul_flops"]
    return {"case": case, "steps": steps, "warmup": warmup, "timed_steps": steps - warmup,
            "wall_s": time.time() - started, **r}  # fmt: skip


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="tiny model on CPU: checks the script, not the GPU")
    parser.add_argument("--group", type=int, choices=sorted(GROUPS), help="the cases of one device call")
    parser.add_argument("--cases", nargs="+", choices=CASES, help="these cases instead (default: both groups)")
    parser.add_argument("--steps", type=int, help=f"steps of {', '.join(LONG_CASES)} (default 40; --tiny 13)")
    parser.add_argument("--short-steps", type=int, help="steps of the save and offload cases (default 13)")
    parser.add_argument("--warmup", type=int, help="first steps left out of tokens/s (default 10; --tiny 3)")
    parser.add_argument("--short-warmup", type=int, default=3, help="the same for the save and offload cases")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--port", type=int, default=29533)
    parser.add_argument("--case-timeout", type=float, default=240.0, help="seconds before a case is given up")
    parser.add_argument("--out", type=Path, default=Path("gpu-bench"), help="folder for the JSON and the table")
    args = parser.parse_args()
    if args.group and args.cases:
        parser.error("--group or --cases, not both")
    args.cases = list(GROUPS[args.group]) if args.group else args.cases or [*GROUPS[1], *GROUPS[2]]
    args.warmup = args.warmup if args.warmup is not None else 3 if args.tiny else 10
    args.steps = args.steps or (13 if args.tiny else 40)
    args.short_steps = args.short_steps or 13
    if min(args.steps - args.warmup, args.short_steps - args.short_warmup) < MIN_TIMED or args.warmup < 1:
        parser.error(
            f"each case is timed over at least {MIN_TIMED} steps after a warm-up of at least 1: "
            f"--steps {args.steps} less --warmup {args.warmup}, --short-steps {args.short_steps} less "
            f"--short-warmup {args.short_warmup}"
        )
    args.seq = 128 if args.tiny else args.seq_len
    return args


def probe_device(args: argparse.Namespace) -> dict:
    cmd = [sys.executable, str(HERE / "gpu_probe.py"), "--seq-len", str(args.seq), *(["--tiny"] if args.tiny else [])]
    return json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.splitlines()[-1])


def main() -> None:
    args = parse_args()
    args.probe = probe_device(args)
    if not args.tiny and args.probe["device"] != "cuda":
        sys.exit("no CUDA device: run on a GPU machine, or pass --tiny to check the script on CPU")
    args.out.mkdir(parents=True, exist_ok=True)
    results = {}
    with tempfile.TemporaryDirectory(prefix="fsdpjob-gpu-") as tmp:
        root = Path(tmp)
        t0 = time.time()
        model, data = build_assets(root, args.tiny)
        from transformers import AutoConfig

        from fsdpjob.jobs.report.metrics import model_flops_per_token

        args.flops_per_token = model_flops_per_token(AutoConfig.from_pretrained(model), seq_len=args.seq)
        print(f"assets            {time.time() - t0:.0f} s", flush=True)
        for case in args.cases:
            r = run_case(case, root, model, data, args)
            (args.out / f"{case}.json").write_text(json.dumps(r, indent=1, default=str) + "\n")
            results[case] = r
            print(f"{case:<17} {_status(r)}", flush=True)
    table = render_table(results, args)
    print("\n" + table, flush=True)
    suffix = f"-group{args.group}" if args.group else ""
    settings = {k: v for k, v in vars(args).items() if k not in ("probe", "out")}
    (args.out / f"table{suffix}.txt").write_text(table + "\n")
    summary = {"probe": args.probe, "settings": settings, "cases": results}
    (args.out / f"results{suffix}.json").write_text(json.dumps(summary, indent=1, default=str) + "\n")


def _status(r: dict) -> str:
    if "error" in r:
        return f"FAILED: {r['error'].splitlines()[0][:200]}"
    real = f" ({r['target_rate']:.0f} target tok/s)" if r.get("target_rate") else ""
    return f"{r['rate']:.0f} tok/s{real}, {r['wall_s']:.0f} s"


if __name__ == "__main__":
    main()
