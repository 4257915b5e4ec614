"""Worker tokens/s (jobs.train.run) against a minimal hand-written FSDP2 loop: same model, batches and ranks.

Run: OMP_NUM_THREADS=1 python bench/worker_throughput.py [--rounds 3] [--warmup 3] [--steps 15]

Both sides run on the same 2 gloo ranks (1 thread each), alternating worker / hand-written runs
(A B A B ...) inside the same two processes, each run on a fresh process group and model, on a
random Llama (vocab 4096, hidden 256, 4 layers, about 5 M parameters), packed text
of seq_len 256, micro batch 4 per rank, bf16 mixed precision with fp32 master weights and reduction.
Tokens/s counts the steps after the warm-up steps on rank 0's clock: the worker's from the times of
its metrics.jsonl lines (log_every=1), the hand-written loop's from its own time stamps. Tokens
per CPU-second of rank 0 (time.process_time around the same steps; the worker's train_step is
wrapped to read it) are printed too: on a shared, oversubscribed machine they are far steadier
than wall time. Target: the median ratio worker / hand-written >= 0.95.

This module also holds what bench/memory_scaling.py and bench/resume_latency.py share: random
assets, run folders in the layout orchestrator/submit.py writes, and rank processes launched as
torchrun would (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, LOCAL_RANK, OMP_NUM_THREADS=1).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))  # free_port

from distributed import free_port  # noqa: E402

TARGET = 0.95


@dataclass(frozen=True)
class ModelSize:
    vocab: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int


THROUGHPUT_MODEL = ModelSize(vocab=4096, hidden=256, intermediate=688, layers=4, heads=8, kv_heads=4)


# ------------------------------------------------------------------------------------------------
# Shared: assets, run folders, rank processes.


def random_text(lines: int, seed: int = 0) -> list[str]:
    """Lines of made-up words with Zipf-like frequencies: enough distinct merges for a BPE of a few thousand tokens."""
    rng = random.Random(seed)
    syllables = [c + v for c in "bcdfghjklmnprstvwz" for v in "aeiou"]
    lexicon = ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 4))) for _ in range(30000)]
    cumulative, total = [], 0.0
    for i in range(len(lexicon)):
        total += 1.0 / (i + 1)
        cumulative.append(total)
    return [" ".join(rng.choices(lexicon, cum_weights=cumulative, k=rng.randint(40, 120))) for _ in range(lines)]


def make_assets(root: Path, size: ModelSize, *, lines: int = 3000, max_positions: int = 512) -> tuple[Path, Path]:
    """A BPE tokenizer and a random Llama of ``size`` in root/model, text lines in root/data.jsonl."""
    from transformers.utils import logging as hf_logging

    from fsdpjob.jobs.assets import build_tiny_model, build_tokenizer

    hf_logging.disable_progress_bar()

    texts = random_text(lines)
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    model = root / "model"
    tokenizer = build_tokenizer(model, texts, vocab_size=size.vocab)
    if len(tokenizer) != size.vocab:
        raise RuntimeError(f"the tokenizer has {len(tokenizer)} tokens, not {size.vocab}: give random_text more lines")
    build_tiny_model(
        model, hidden_size=size.hidden, intermediate_size=size.intermediate, num_layers=size.layers,
        num_heads=size.heads, num_kv_heads=size.kv_heads, max_position_embeddings=max_positions,
    )  # fmt: skip
    return model, data


def job_spec(
    name: str, model: Path, data: Path, *, seq_len: int, micro_batch: int, max_steps: int, **sections: dict
) -> dict:
    """A JobSpec dict: packed text, constant LR (so any step costs the same), time-based saves off."""
    spec: dict[str, Any] = {
        "name": name,
        "model": {"path": str(model)},
        "data": {"path": str(data), "seq_len": seq_len, "packing": True},
        "train": {"max_steps": max_steps, "micro_batch_size": micro_batch, "lr": 1e-3, "lr_schedule": "constant",
                  "log_every": 1},
        "checkpoint": {"interval_minutes": 0},
    }  # fmt: skip
    for section, values in sections.items():
        spec.setdefault(section, {}).update(values)
    return spec


def write_run_folder(run_dir: Path, spec: dict, resume_from: str | None = None) -> Path:
    """The run folder the worker reads (spec.json as orchestrator/submit.py::_write_run_folder writes it)."""
    from fsdpjob.orchestrator.core.spec import JobSpec

    resolved = JobSpec.model_validate(spec)
    run_dir.mkdir(parents=True)
    meta = {"spec": resolved.model_dump(mode="json"), "spec_hash": resolved.spec_hash(), "resume_from": resume_from}
    (run_dir / "spec.json").write_text(json.dumps(meta, indent=1, sort_keys=True), encoding="utf-8")
    return run_dir


def launch_ranks(argv: list[str], world: int, log_dir: Path, *, timeout: float = 900, env: dict | None = None) -> float:
    """Run ``python argv`` on ``world`` local ranks; return the wall time from just before the first spawn.

    Each rank's output goes to log_dir/rank<r>.log; a failing rank raises with the end of its log.
    """
    port = str(free_port())
    log_dir.mkdir(parents=True, exist_ok=True)
    started = time.time()
    procs = []
    for rank in range(world):
        rank_env = dict(os.environ, **(env or {}), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                        LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=port, OMP_NUM_THREADS="1")
        log = open(log_dir / f"rank{rank}.log", "w", encoding="utf-8")  # noqa: SIM115 - closed after wait
        proc = subprocess.Popen([sys.executable, *argv], env=rank_env, stdout=log, stderr=subprocess.STDOUT)
        procs.append((proc, log))
    try:
        for rank, (proc, log) in enumerate(procs):
            rc = proc.wait(timeout=max(1.0, started + timeout - time.time()))
            log.close()
            if rc != 0:
                tail = (log_dir / f"rank{rank}.log").read_text(encoding="utf-8")[-3000:]
                raise RuntimeError(f"rank {rank} of {' '.join(argv)} exited {rc}; end of its log:\n{tail}")
    finally:
        for proc, log in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()
    return time.time() - started


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def proc_status_mib(field: str) -> float:
    """A kB field of /proc/self/status (VmRSS, VmHWM, ...) in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise KeyError(field)


def load_note() -> str:
    return f"load average (1 min) {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs"


# ------------------------------------------------------------------------------------------------
# The hand-written loop (runs in each rank process).


def hand_written_rank(run_dir: Path) -> None:
    """Meta init, fully_shard per layer + root, rank-0 load + broadcast, AdamW; the worker's batches."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from fsdpjob.jobs.data import BatchStream, build_sequences, read_examples
    from fsdpjob.orchestrator.core.spec import JobSpec

    torch.set_num_threads(1)
    spec = JobSpec.model_validate(json.loads((run_dir / "spec.json").read_text())["spec"])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    with torch.device("meta"):
        config = AutoConfig.from_pretrained(spec.model.path)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    compute = {"bf16": torch.bfloat16, "fp32": torch.float32}[spec.fsdp.mixed_precision]
    policy = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    model.to_empty(device="cpu")
    rotary = model.model.rotary_emb  # non-persistent buffers hold garbage after to_empty
    inv_freq, rotary.attention_scaling = rotary.compute_default_rope_parameters(rotary.config)
    rotary.inv_freq.copy_(inv_freq)
    rotary.original_inv_freq.copy_(inv_freq)
    full = load_file(str(Path(spec.model.path) / "model.safetensors")) if rank == 0 else {}
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.train.lr, betas=spec.train.betas, weight_decay=0.0)

    tokenizer = AutoTokenizer.from_pretrained(spec.model.path)
    table = build_sequences(read_examples(spec.data, tokenizer), spec.data.seq_len, True, tokenizer.pad_token_id)
    stream = BatchStream(table, seed=spec.train.seed, shuffle=True, micro_batch_size=spec.train.micro_batch_size,
                         grad_accum_steps=1, dp_rank=rank, dp_world=world)  # fmt: skip
    clock, losses = [(time.time(), time.process_time())], []
    for _ in range(spec.train.max_steps):
        for batch in stream.next_step():
            logits = model(input_ids=batch.input_ids, use_cache=False).logits
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)).float(), batch.labels[:, 1:].reshape(-1))
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), spec.train.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        clock.append((time.time(), time.process_time()))
        losses.append(loss.item())
    tokens = [int((b.labels[:, 1:] != -100).sum()) for b in stream.next_step()]  # same shape every step: packed
    mean_losses = torch.tensor(losses)  # the worker logs the mean over ranks: compare like with like
    dist.all_reduce(mean_losses)
    if rank == 0:
        record = {"clock": clock, "losses": (mean_losses / world).tolist(), "tokens_per_step": sum(tokens) * world}
        (run_dir / "hand_written.json").write_text(json.dumps(record), encoding="utf-8")
    dist.destroy_process_group()


# ------------------------------------------------------------------------------------------------
# Measurement.


def worker_rounds(runs: list[dict]) -> None:
    """In one rank process: the planned runs in order, each on a fresh process group (its own port)."""
    from fsdpjob.jobs import train

    clock: list[tuple[float, float]] = []
    real_step = train.train_step

    def clocked_step(*args, **kwargs):
        result = real_step(*args, **kwargs)
        clock.append((time.time(), time.process_time()))
        return result

    train.train_step = clocked_step
    for run in runs:
        os.environ["MASTER_PORT"] = str(run["port"])
        run_dir = Path(run["run_dir"])
        if run["kind"] == "hand-written":
            hand_written_rank(run_dir)
            continue
        clock.clear()
        start = (time.time(), time.process_time())
        train.run(str(run_dir))
        if os.environ["RANK"] == "0":
            (run_dir / "clock.json").write_text(json.dumps([start, *clock]), encoding="utf-8")


def rates(run: dict, warmup: int) -> dict[str, float]:
    """Tokens per wall second and per CPU second of rank 0 after ``warmup`` steps, and the first loss.

    The worker's wall rate comes from its metrics.jsonl (log_every=1), its CPU rate from the clock the
    rank wrapper kept; the hand-written loop's both from its own clock.
    """
    run_dir = Path(run["run_dir"])
    if run["kind"] == "worker":
        metrics = read_jsonl(run_dir / "metrics.jsonl")
        clock = json.loads((run_dir / "clock.json").read_text())
        tokens = metrics[-1]["tokens"] - metrics[warmup - 1]["tokens"]
        wall = metrics[-1]["time"] - metrics[warmup - 1]["time"]
        first_loss = metrics[0]["loss"]
    else:
        record = json.loads((run_dir / "hand_written.json").read_text())
        clock = record["clock"]
        tokens = record["tokens_per_step"] * (len(clock) - 1 - warmup)
        wall = clock[-1][0] - clock[warmup][0]
        first_loss = record["losses"][0]
    cpu = clock[-1][1] - clock[warmup][1]
    return {"wall": tokens / wall, "cpu": tokens / cpu, "loss": first_loss}


def plan_runs(root: Path, spec: dict, rounds: int) -> list[dict]:
    runs = []
    for index in range(2 * rounds):
        kind = ("worker", "hand-written")[index % 2]
        run_dir = write_run_folder(root / f"{index:02d}-{kind}", spec)
        runs.append({"kind": kind, "run_dir": str(run_dir), "port": free_port()})
    return runs


def summary(results: list[tuple[str, dict[str, float]]]) -> None:
    for measure, unit in (("wall", "tok/s"), ("cpu", "tok per CPU-s of rank 0")):
        worker = [r[measure] for kind, r in results if kind == "worker"]
        hand = [r[measure] for kind, r in results if kind == "hand-written"]
        ratio = statistics.median(worker) / statistics.median(hand)
        pairs = ", ".join(f"{w / h:.3f}" for w, h in zip(worker, hand))
        verdict = "ok" if ratio >= TARGET else "BELOW"
        print(f"{unit}: median worker {statistics.median(worker):.0f}, hand-written {statistics.median(hand):.0f}; "
              f"ratio {ratio:.3f} (pairs: {pairs}); target >= {TARGET}: {verdict}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="worker / hand-written pairs (A B A B ...)")
    parser.add_argument("--warmup", type=int, default=3, help="steps left out of the rate")
    parser.add_argument("--steps", type=int, default=15, help="steps measured after the warm-up")
    parser.add_argument("--mixed-precision", choices=("bf16", "fp32"), default="bf16")
    parser.add_argument("--rank-worker", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--rank-rounds", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_worker:  # one plain worker run (bench/resume_latency.py uses it)
        from fsdpjob.jobs.train import run

        run(str(args.rank_worker))
        return
    if args.rank_rounds:
        worker_rounds(json.loads(args.rank_rounds.read_text())["runs"])
        return

    print(load_note(), flush=True)
    with tempfile.TemporaryDirectory(prefix="fsdpjob-throughput-") as tmp:
        root = Path(tmp)
        model, data = make_assets(root, THROUGHPUT_MODEL)
        spec = job_spec("throughput", model, data, seq_len=256, micro_batch=4, max_steps=args.warmup + args.steps,
                        fsdp={"mixed_precision": args.mixed_precision})  # fmt: skip
        runs = plan_runs(root, spec, args.rounds)
        plan = root / "plan.json"
        plan.write_text(json.dumps({"runs": runs}), encoding="utf-8")
        print(f"model {asdict(THROUGHPUT_MODEL)}; 2 ranks x 1 thread, seq 256, micro batch 4/rank, "
              f"{args.mixed_precision}; {args.warmup} warm-up + {args.steps} measured steps per run; "
              f"{2 * args.rounds} runs alternating in the same 2 rank processes", flush=True)  # fmt: skip
        wall = launch_ranks([__file__, "--rank-rounds", str(plan)], 2, root / "logs")
        results = [(run["kind"], rates(run, args.warmup)) for run in runs]
    print(f"{'run':>3} {'kind':<13} {'tok/s':>7} {'tok/CPU-s':>9} {'loss@1':>8}")
    for index, (kind, r) in enumerate(results):
        print(f"{index:>3} {kind:<13} {r['wall']:>7.0f} {r['cpu']:>9.0f} {r['loss']:>8.4f}")
    summary(results)
    print(f"all runs: {wall:.0f} s")
    print(load_note())


if __name__ == "__main__":
    main()
