"""Planner accuracy on CPU: predicted vs measured peak memory per rank of real FSDP2 training steps over gloo.

Each case writes a small random Llama (config.json + safetensors), plans it with ``make_plan`` (CPU mode: the device
is host memory per rank) and runs the worker itself on spawned gloo ranks: ``jobs.model.load_model`` (meta init,
activation checkpointing, ``fully_shard`` per layer then the root, each rank reading its own weight shards), AdamW as
``jobs/train.py`` builds it, and two ``jobs.train.train_step`` calls (forward, loss, backward, clipping, step).
Measured = peak RSS (VmHWM, reset through /proc/self/clear_refs) above the RSS after imports, process group and a
warm-up step of a one-layer model; predicted = the plan's per-rank peak without its fixed process item. The load
column compares rank 0's peak while loading with the plan's load figure for it (information only).

The workers run with glibc's default allocator, as the shipped profiles do: it raises its mmap threshold after
each free of a large block and then keeps freed activations in its heap for reuse, which the planner models as
slack. --frozen also measures with the threshold frozen at 128 KiB (MALLOC_MMAP_THRESHOLD_=131072): RSS then
tracks live tensors, and each step maps and faults its memory afresh (the step time column shows the cost).

    OMP_NUM_THREADS=1 python bench/plan_accuracy.py            # the full grid (a few minutes on 2 cores)
    OMP_NUM_THREADS=1 python bench/plan_accuracy.py --quick    # the three cases of tests/worker/test_plan_accuracy.py
    OMP_NUM_THREADS=1 python bench/plan_accuracy.py --frozen   # also measure with the mmap threshold frozen
    OMP_NUM_THREADS=1 python bench/plan_accuracy.py --moe      # the mixture-of-experts cases only
    OMP_NUM_THREADS=1 python bench/plan_accuracy.py --qlora    # the QLoRA case only (a 4-bit base, issue 56)
"""

from __future__ import annotations

import argparse
import gc
import os
import re
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))  # run_ranks

from distributed import run_ranks  # noqa: E402

MiB = 1024**2
FROZEN_MMAP_THRESHOLD = "131072"  # glibc's initial threshold, frozen: freed blocks >= 128 KiB go back to the OS


@dataclass(frozen=True)
class Case:
    size: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    seq_len: int
    micro_batch: int = 2
    grad_accum: int = 1
    world: int = 2
    mp: str = "bf16"
    ac: bool = False
    dtype: str = "float32"
    attn: str = "sdpa"
    reshard: bool = True
    experts: int = 0  # a Mixtral of this many experts (intermediate: each expert's), routed top_k; 0: Llama
    top_k: int = 2
    qlora: bool = False  # LoRA r 8 on every linear layer of a 4-bit (model.quantize nf4) base

    @property
    def label(self) -> str:
        flags = {
            "AC": self.ac,
            f"accum{self.grad_accum}": self.grad_accum > 1,
            "bf16-master": self.dtype == "bfloat16",
            "eager": self.attn == "eager",
            "no-reshard": not self.reshard,
            f"moe{self.experts}x{self.top_k}": self.experts > 0,
            "qlora": self.qlora,
        }
        return " ".join([self.size, f"w{self.world}", self.mp, *(name for name, on in flags.items() if on)])


SIZES = {
    "S": dict(hidden=128, intermediate=344, layers=4, heads=4, kv_heads=2, vocab=1024, seq_len=512),
    "M": dict(hidden=256, intermediate=688, layers=4, heads=8, kv_heads=4, vocab=4096, seq_len=512),
    "L": dict(hidden=512, intermediate=1376, layers=6, heads=8, kv_heads=4, vocab=8192, seq_len=512),
}


def grid() -> list[Case]:
    out = []
    for size, dims in SIZES.items():
        base = Case(size, **dims)
        out += [
            base,
            replace(base, ac=True),
            replace(base, mp="fp32"),
            replace(base, world=1),
            # the local profile refuses more ranks than this machine has cores
            *([replace(base, world=4, ac=True)] if (os.cpu_count() or 1) >= 4 else []),
        ]
    medium = Case("M", **SIZES["M"])
    out += [replace(medium, attn="eager"), replace(medium, dtype="bfloat16"),
            replace(medium, grad_accum=2, micro_batch=1), replace(medium, reshard=False)]
    return out


# Mixture of experts (issue 56): the S model with 8 experts of its MLP's width, top-2 routed.
MOE = [
    replace(Case("S", **SIZES["S"]), experts=8),
    replace(Case("S", **SIZES["S"]), experts=8, ac=True),
]

# QLoRA (issue 56): the M model's frozen decoder linears in 4 bits, LoRA r 8 on each.
QLORA = [replace(Case("M", **SIZES["M"]), qlora=True)]
QLORA_SPEC = {"lora": {"r": 8, "alpha": 16.0}, "quantize": "nf4"}

QUICK = [
    Case("S", **SIZES["S"]),
    replace(Case("M", **SIZES["M"]), ac=True, world=1),
    replace(Case("M", **SIZES["M"]), mp="fp32", world=2),
]


# ------------------------------------------------------------------------------------------------
# Prediction (login-node side: json + arithmetic only).


def write_model(case: Case, folder: Path) -> Path:
    """A randomly initialised model folder (config.json + fp32 safetensors), as the worker loads it."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, LlamaConfig, MixtralConfig

    moe = {"num_local_experts": case.experts, "num_experts_per_tok": case.top_k} if case.experts else {}
    cfg = (MixtralConfig if case.experts else LlamaConfig)(
        **moe,
        vocab_size=case.vocab,
        hidden_size=case.hidden,
        intermediate_size=case.intermediate,
        num_hidden_layers=case.layers,
        num_attention_heads=case.heads,
        num_key_value_heads=case.kv_heads,
        max_position_embeddings=max(case.seq_len, 64),
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    transformers.utils.logging.disable_progress_bar()
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(folder)
    return folder


def plan_for(case: Case, model_dir: Path):
    from fsdpjob.orchestrator.core.jobspec.profiles import load_profile
    from fsdpjob.orchestrator.core.jobspec.spec import JobSpec
    from fsdpjob.orchestrator.planner.fit import make_plan
    from fsdpjob.orchestrator.planner.resolve import resolve

    spec = JobSpec.model_validate(
        {
            "name": "accuracy",
            "resources": {"tasks_per_node": case.world},
            "model": {"path": str(model_dir), "dtype": case.dtype, "activation_checkpointing": case.ac,
                      "attn_implementation": case.attn, **(QLORA_SPEC if case.qlora else {})},
            "data": {"path": "unused.jsonl", "seq_len": case.seq_len},
            "train": {"max_steps": 2, "micro_batch_size": case.micro_batch, "grad_accum_steps": case.grad_accum},
            "fsdp": {"mixed_precision": case.mp, "reshard_after_forward": case.reshard},
        }
    )
    return make_plan(resolve(spec, load_profile("local")))


def predict(case: Case, model_dir: Path) -> int:
    """The plan's per-rank training peak above the process baseline, in bytes."""
    device = plan_for(case, model_dir).device
    return device.peak - device.runtime.bytes


# ------------------------------------------------------------------------------------------------
# Measurement (worker side: the worker's own load_model and train_step on spawned gloo ranks).


def _status_kib(field: str) -> int:
    return int(re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M).group(1))


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS


def _load(model_dir: str, case: Case, env, mesh):
    import torch

    from fsdpjob.jobs.model import FULL, NONE, load_model
    from fsdpjob.orchestrator.core.jobspec.modelspec import LoraSpec

    qlora = {"lora": LoraSpec(**QLORA_SPEC["lora"]), "quantize": QLORA_SPEC["quantize"]} if case.qlora else {}
    return load_model(
        model_dir, env=env, mesh=mesh, dtype=getattr(torch, case.dtype), attn_implementation=case.attn,
        mixed_precision=case.mp, reshard_after_forward=case.reshard,
        activation_checkpointing=FULL if case.ac else NONE, cpu_offload=False, **qlora,
    )


def _train(model, case: Case, env, steps: int) -> float:
    """``steps`` optimizer steps exactly as the worker runs them; the seconds of the last one."""
    import torch

    from fsdpjob.jobs.data import MicroBatch, count_tokens
    from fsdpjob.jobs.model.lora import trainable_parameters
    from fsdpjob.jobs.step import train_step

    model.train()
    # as jobs/train.py
    optimizer = torch.optim.AdamW(trainable_parameters(model), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.0, fused=True)
    gen = torch.Generator().manual_seed(env.rank)
    for _ in range(steps):
        start = time.perf_counter()
        batches = []
        for _ in range(case.grad_accum):
            ids = torch.randint(0, case.vocab, (case.micro_batch, case.seq_len), generator=gen)
            batches.append(MicroBatch(ids, ids.clone(), torch.zeros(case.micro_batch), torch.zeros(case.micro_batch)))
        # Every rank draws the same shape with no padding, so the global count is the local one times the world.
        tokens = sum(count_tokens(mb.labels) for mb in batches) * env.world_size
        # As the worker does where the plan says the unsharded gradients fit (always, for these small cases).
        train_step(model, optimizer, batches, env.device, tokens=tokens, max_grad_norm=1.0,
                   defer_grad_sync=case.grad_accum > 1)
    return time.perf_counter() - start


def measure_rank(rank: int, world_size: int, *, model_dir: str, case: dict, steps: int = 2) -> dict:
    """This rank's peak RSS above its baseline: at load and over ``steps`` training steps (bytes)."""
    import torch.distributed as dist

    from fsdpjob.jobs.dist import close_distributed, init_distributed
    from fsdpjob.jobs.model.parallelize import build_mesh

    c = Case(**case)
    env = init_distributed(600)
    try:
        mesh = build_mesh(env, 1)
        # Warm-up on a one-layer model: faults in the kernels' code and the allocator's arenas.
        _train(_load(str(Path(model_dir) / "warmup"), _warmup(c), env, mesh), _warmup(c), env, 1)
        gc.collect()
        dist.barrier()
        _reset_peak()
        base = _status_kib("VmRSS") * 1024
        model = _load(model_dir, c, env, mesh)
        load = _status_kib("VmHWM") * 1024 - base
        _reset_peak()
        step_s = _train(model, c, env, steps)
        return {"peak": _status_kib("VmHWM") * 1024 - base, "load": load, "step_s": step_s, "base": base}
    finally:
        close_distributed()


def _warmup(case: Case) -> Case:
    tiny = dict(hidden=64, intermediate=128, layers=1, heads=4, kv_heads=2, vocab=128, seq_len=32, grad_accum=1)
    return replace(case, **tiny)


def measure(case: Case, model_dir: Path, stock_malloc: bool = True) -> dict:
    """Run the case on spawned ranks: {peak (worst rank), load (per rank), step_s, base} in bytes and seconds."""
    if not (model_dir / "warmup").is_dir():
        write_model(_warmup(case), model_dir / "warmup")
    saved = os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)
    if not stock_malloc:
        os.environ["MALLOC_MMAP_THRESHOLD_"] = FROZEN_MMAP_THRESHOLD  # spawned ranks inherit it at exec
    try:
        results = run_ranks(measure_rank, case.world, timeout=900, model_dir=str(model_dir), case=asdict(case))
    finally:
        os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)
        if saved is not None:
            os.environ["MALLOC_MMAP_THRESHOLD_"] = saved
    worst = max(results, key=lambda r: r["peak"])
    return {**worst, "load": [r["load"] for r in results]}


def predict_load_rank0(case: Case, model_dir: Path) -> int:
    """Rank 0's host memory at load above its baseline, from the plan's per-node load figure: its shard, plus what
    the weight read holds (each rank one shard of the largest tensor, or the full checkpoint on rank 0)."""
    from fsdpjob.orchestrator.planner.memory import CPU_RUNTIME_BYTES

    plan = plan_for(case, model_dir)
    u = plan.setup
    shard = -(-plan.params.total // u.shard_degree) * u.model_bytes
    read = plan.host.load_rank0 - u.tasks_per_node * (shard + CPU_RUNTIME_BYTES)
    return shard + (read // u.tasks_per_node if plan.host.own_shards else read)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="only the three test cases")
    ap.add_argument("--moe", action="store_true", help="only the mixture-of-experts cases")
    ap.add_argument("--qlora", action="store_true", help="only the QLoRA case")
    ap.add_argument("--frozen", action="store_true", help="also measure with glibc's mmap threshold frozen at 128 KiB")
    ap.add_argument("--repeat", type=int, default=1, metavar="N",
                    help="measure each case N times with the default allocator: its peak varies from run to run")
    args = ap.parse_args()
    cases = QUICK if args.quick else MOE if args.moe else QLORA if args.qlora else grid() + MOE + QLORA
    stock = f" {'frozen':>11} {'error':>7} {'s/step':>6}" if args.frozen else ""
    header = f"{'case':<26} {'predicted':>9} {'measured':>11} {'error':>15} {'s/step':>6}{stock}"
    print(f"{header}   load, rank 0: predicted / measured (MiB)")
    errors = []
    with tempfile.TemporaryDirectory() as tmp:
        for case in cases:
            model_dir = write_model(case, Path(tmp) / case.label.replace(" ", "_"))
            pred, runs = predict(case, model_dir), [measure(case, model_dir) for _ in range(args.repeat)]
            low, high = min(r["peak"] for r in runs), max(r["peak"] for r in runs)
            got = runs[0]
            errors += [(pred - high) / high, (pred - low) / low]
            measured = f"{low / MiB:.1f}-{high / MiB:.1f}" if high > low else f"{low / MiB:.1f}"
            error = f"{errors[-2]:+.1%}..{errors[-1]:+.1%}" if high > low else f"{errors[-1]:+.1%}"
            row = f"{case.label:<26} {pred / MiB:>9.1f} {measured:>11} {error:>15} {got['step_s']:>6.2f}"
            if args.frozen:
                st = measure(case, model_dir, stock_malloc=False)
                row += f" {st['peak'] / MiB:>11.1f} {(pred - st['peak']) / st['peak']:>+7.1%} {st['step_s']:>6.2f}"
            load = f"{predict_load_rank0(case, model_dir) / MiB:.0f} / {got['load'][0] / MiB:.0f}"
            print(f"{row}   {load}", flush=True)
    worst = max(errors, key=abs)
    print(f"worst error {worst:+.1%}, mean |error| {sum(map(abs, errors)) / len(errors):.1%} over {len(cases)} cases"
          f" (against the lowest and the highest of {args.repeat} measurements each)")


if __name__ == "__main__":
    main()
