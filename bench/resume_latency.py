"""Resume latency of the worker: from process start to the first finished step after a resume, phase by phase.

Run: OMP_NUM_THREADS=1 python bench/resume_latency.py [--imports-runs 3]

A random Llama of about 40 M parameters (vocab 8192, hidden 512, 10 layers) trains 4 steps on 2 gloo
ranks (jobs.train.run, checkpoints at steps 2 and 4); step 4's checkpoint is then deleted, as if the
job had died before it, and the same run folder is started again: the worker finds step 2, loads it
and trains steps 3 and 4 with log_every=1. That second start is what is timed, on rank 0's wall
clock, from just before the parent spawns the ranks:

* interpreter start and imports: time stamps the rank process takes at its first line and after
  each import (torch; transformers and AutoModelForCausalLM; the Llama model class, which
  transformers imports lazily; the worker modules);
* the worker's own phases: time stamps around the real functions run() calls (init_distributed,
  load_model and inside it apply_fsdp and each rank's read of its own weight shards, load_or_build (the packed
  data: read back from the run's cache on a restart), CheckpointManager's constructor, find_resume and
  load, the first train_step), wrapped in place;
* the worker's events.jsonl (start, resume, ready with setup_s) and its first metrics.jsonl line.

The import cost is also measured on its own, in the same run:
``python -c "import torch, transformers; from transformers import AutoModelForCausalLM"`` (median of
--imports-runs runs, with `python -c pass` as the floor).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from common import ModelSize, job_spec, launch_ranks, load_note, make_assets, read_jsonl, write_run_folder

RESUME_MODEL = ModelSize(vocab=8192, hidden=512, intermediate=1376, layers=10, heads=8, kv_heads=8)
IMPORTS = "import torch, transformers; from transformers import AutoModelForCausalLM"

# (phase, mark at its end), in the order they happen; each phase lasts from the previous mark to its own.
PHASES = [
    ("interpreter start + bench script", "entered"),
    ("import torch", "torch"),
    ("import transformers + AutoModelForCausalLM", "transformers"),
    ("import the Llama model class (lazy in transformers)", "model_class"),
    ("import the worker (fsdpjob.jobs.train)", "worker"),
    ("run(): spec, signal handlers", "init_distributed.start"),
    ("process group init (gloo)", "init_distributed.end"),
    ("reporter, 'start' event", "event.start"),
    ("device mesh", "load_model.start"),
    ("model: config + meta init", "apply_fsdp.start"),
    ("model: fully_shard per layer + root", "apply_fsdp.end"),
    ("model: to_empty + non-persistent buffers", "load_sharded.start"),
    ("model: each rank reads its own safetensors shards", "load_sharded.end"),
    ("optimizer, scheduler, tokenizer load", "load_or_build.start"),
    ("data: packed table (the run's cache on a restart)", "load_or_build.end"),
    ("checkpoint manager (its own gloo group)", "checkpoint_manager.end"),
    ("find + verify the newest checkpoint", "find_resume.end"),
    ("checkpoint load (DCP, 2 calls)", "checkpoint_load.end"),
    ("'resume' and 'ready' events", "event.ready"),
    ("flops per token, loop entry", "train_step.start"),
    ("first step after the resume", "train_step.end"),
    ("metrics line written", "metrics.first"),
]


def _timed(owner: Any, name: str, label: str, marks: dict[str, float]) -> None:
    """Replace owner.name by a wrapper that records label.start (first call) and label.end (last call)."""
    real: Callable = getattr(owner, name)

    def wrapper(*args, **kwargs):
        marks.setdefault(f"{label}.start", time.time())
        try:
            return real(*args, **kwargs)
        finally:
            marks[f"{label}.end"] = time.time()

    setattr(owner, name, wrapper)


def rank_main(run_dir: Path, entered: float) -> None:
    """One worker rank: time stamps around the imports and the real worker functions, then run()."""
    marks = {"entered": entered}
    import torch

    marks["torch"] = time.time()
    import transformers  # noqa: F401
    from transformers import AutoModelForCausalLM  # noqa: F401

    marks["transformers"] = time.time()
    from transformers import LlamaForCausalLM  # noqa: F401

    marks["model_class"] = time.time()
    from fsdpjob.jobs import parts, train
    from fsdpjob.jobs.model import build as model

    marks["worker"] = time.time()
    torch.set_num_threads(1)
    _timed(train, "init_distributed", "init_distributed", marks)
    _timed(parts, "load_model", "load_model", marks)
    _timed(model, "apply_fsdp", "apply_fsdp", marks)
    _timed(model, "load_sharded", "load_sharded", marks)
    _timed(parts, "load_or_build", "load_or_build", marks)
    _timed(train.CheckpointManager, "__init__", "checkpoint_manager", marks)
    _timed(train.CheckpointManager, "find_resume", "find_resume", marks)
    _timed(train.CheckpointManager, "load", "checkpoint_load", marks)
    real_step = train.train_step

    def first_step_timed(*args, **kwargs):
        start = time.time()
        result = real_step(*args, **kwargs)
        if "train_step.end" not in marks:
            marks.update({"train_step.start": start, "train_step.end": time.time()})
        return result

    train.train_step = first_step_timed
    train.run(str(run_dir))
    record = {"pid": os.getpid(), "marks": marks}
    (run_dir / f"resume-rank{os.environ['RANK']}.json").write_text(json.dumps(record), encoding="utf-8")


def import_seconds(code: str, runs: int) -> float:
    """Median wall time of ``python -c code`` over ``runs`` runs after one warm-up."""
    times = []
    for i in range(runs + 1):
        start = time.perf_counter()
        subprocess.run([sys.executable, "-c", code], check=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
        if i:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def resumed_marks(run_dir: Path, launched: float) -> tuple[dict[str, float], dict[str, Any], float]:
    """Rank 0's marks with the worker's events and first metrics line added; the rank-1 first step end."""
    ranks = [json.loads((run_dir / f"resume-rank{r}.json").read_text()) for r in range(2)]
    marks = dict(ranks[0]["marks"], launched=launched)
    events = {e["event"]: e for e in read_jsonl(run_dir / "events.jsonl") if e["pid"] == ranks[0]["pid"]}
    marks["event.start"], marks["event.ready"] = events["start"]["time"], events["ready"]["time"]
    first, second = [m for m in read_jsonl(run_dir / "metrics.jsonl") if m["time"] > launched][:2]
    marks["metrics.first"] = first["time"]
    data = [e for e in read_jsonl(run_dir / "events.jsonl") if e["event"] == "data"]
    facts = {"resume": events["resume"], "ready": events["ready"], "first": first, "second": second, "data": data}
    return marks, facts, ranks[1]["marks"]["train_step.end"]


def report(marks: dict[str, float], facts: dict[str, Any], rank1_end: float, imports: dict[str, float]) -> None:
    launched = marks["launched"]
    print(f"resumed at step {facts['resume']['step']} from {Path(facts['resume']['checkpoint']).name}; "
          f"first step after it: {facts['first']['step']}; rank 0, seconds")  # fmt: skip
    print(f"{'phase':<52} {'s':>6} {'at':>6}")
    previous, groups = launched, {"imports": 0.0}
    for phase, mark in PHASES:
        duration = marks[mark] - previous
        if duration < -0.005:
            raise RuntimeError(f"marks out of order at {mark}: {marks}")
        previous = marks[mark]
        if phase.startswith("import"):
            groups["imports"] += duration
        print(f"{phase:<52} {duration:>6.2f} {marks[mark] - launched:>6.2f}")
    groups |= {
        "process group init": marks["init_distributed.end"] - marks["init_distributed.start"],
        "model build (mesh, meta init, FSDP wrap, weight load)": marks["load_model.end"] - marks["event.start"],
        "data (packed table from the run's cache)": marks["load_or_build.end"] - marks["load_or_build.start"],
        "checkpoint find + load": marks["checkpoint_load.end"] - marks["find_resume.start"],
        "first step": marks["train_step.end"] - marks["train_step.start"],
    }
    groups["everything else"] = marks["metrics.first"] - launched - sum(groups.values())
    total = marks["metrics.first"] - launched
    print(f"\n{'summary':<52} {'s':>6} {'share':>6}")
    for name, seconds in groups.items():
        print(f"{name:<52} {seconds:>6.2f} {seconds / total:>6.0%}")
    print(f"{'process start -> first step after resume (rank 0)':<52} {total:>6.2f}")
    print(f"{'  same, rank 1 (its first step end)':<52} {rank1_end - launched:>6.2f}")
    print(f"{'worker ready event setup_s (start -> ready)':<52} {facts['ready']['setup_s']:>6.2f}")
    for e in facts["data"]:  # the first start tokenized and wrote the cache; the timed one read it
        how = "read from the cache" if e["cached"] else "tokenized + packed + cache written"
        print(f"{'data, ' + how + ' (rank 0, data event)':<52} {e['seconds']:>6.2f}")
    steady = facts["second"]["time"] - facts["first"]["time"]
    print(f"{'next step (steady state, from metrics.jsonl)':<52} {steady:>6.2f}")
    print(f"\nstandalone, median of runs: python -c pass {imports['pass']:.2f} s; "
          f"python -c \"{IMPORTS}\" {imports['imports']:.2f} s")  # fmt: skip


def main() -> None:
    entered = time.time()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--imports-runs", type=int, default=3)
    parser.add_argument("--rank", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank:
        rank_main(args.rank, entered)
        return
    print(load_note(), flush=True)
    with tempfile.TemporaryDirectory(prefix="fsdpjob-resume-") as tmp:
        root = Path(tmp)
        model, data = make_assets(root, RESUME_MODEL)
        spec = job_spec("resume", model, data, seq_len=128, micro_batch=2, max_steps=4,
                        checkpoint={"interval_steps": 2})  # fmt: skip
        run_dir = write_run_folder(root / "run", spec)
        plain_worker = [str(Path(__file__).with_name("worker_throughput.py")), "--rank-worker", str(run_dir)]
        first_run = launch_ranks(plain_worker, 2, run_dir / "logs-first")
        print(f"first run (steps 1-4, checkpoints at 2 and 4): {first_run:.1f} s", flush=True)
        shutil.rmtree(run_dir / "checkpoints" / "step-00000004")  # as if the job died before this save
        launched = time.time()
        launch_ranks([__file__, "--rank", str(run_dir)], 2, run_dir / "logs-resume")
        marks, facts, rank1_end = resumed_marks(run_dir, launched)
        print(f"resumed run done; {load_note()}", flush=True)
    imports = {"pass": import_seconds("pass", args.imports_runs), "imports": import_seconds(IMPORTS, args.imports_runs)}
    report(marks, facts, rank1_end, imports)
    print(load_note())


if __name__ == "__main__":
    main()
