"""GRPO's generated tokens/s and the split of its step (generation / scoring / training), both generator backends.

    python bench/grpo_throughput.py [--rounds 2] [--steps 12] [--warmup 2] [--quick]

Every case is jobs.train.run on 2 local CPU ranks over gloo (launched as torchrun would), on one random Llama
(bench/common.py), prompts from random text, 2 reward functions (a digit share and a length check), 16 completions
per step (2 prompts x 4 per rank), 32 new tokens each, fp32:

- ``inprocess``: the training ranks generate in lockstep with the FSDP2-sharded policy (KV cache, per-layer
  all-gathers);
- ``server``: the generation server (jobs/grpo/server.py) runs beside the ranks as the supervisor runs it on its
  own node, here on this machine with 2 torch threads; the ranks publish the policy before every round and ask for
  their completions over HTTP.

Figures (median over the logged steps after --warmup, then over rounds): generated tokens/s (completion tokens of
the step over its generation seconds), and the step's split: generation_s and scoring_s (metrics.jsonl) against the
logged step time (metrics' time between consecutive steps); training is the rest. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ModelSize, launch_ranks, load_note, make_assets, random_text, read_jsonl

SIZE = ModelSize(vocab=2048, hidden=256, intermediate=688, layers=4, heads=4, kv_heads=2)
WORKER = ["-c", "import sys; from fsdpjob.jobs.train import run; run(sys.argv[1])"]
REWARDS = '''
def digits(prompts, completions, **fields):
    return [sum(c.isdigit() for c in text) / max(len(text), 1) for text in completions]


def short(prompts, completions, **fields):
    return [1.0 if len(text) < 40 else 0.0 for text in completions]
'''
NEW_TOKENS = 32


def spec(case: str, model: Path, prompts: Path, rewards: Path, args: argparse.Namespace) -> dict:
    return {"name": case, "model": {"path": str(model)},
            "data": {"path": str(prompts), "seq_len": 96},
            "train": {"max_steps": args.steps, "lr": 1e-5, "lr_schedule": "constant", "log_every": 1,
                      "method": "grpo", "micro_batch_size": 4, "grad_accum_steps": 2},
            "fsdp": {"mixed_precision": "fp32"}, "checkpoint": {"interval_minutes": 0, "interval_steps": 0},
            "grpo": {"reward": [f"{rewards}:digits", f"{rewards}:short"], "num_generations": 4,
                     "max_new_tokens": NEW_TOKENS, "generator": {"backend": case}}}


def start_server(model: Path, folder: Path) -> tuple[subprocess.Popen, str]:
    ready = folder / "ready"
    proc = subprocess.Popen([sys.executable, "-m", "fsdpjob.jobs.grpo.server", "--model", str(model), "--port", "0",
                             "--ready-file", str(ready), "--threads", "2", "--device", "cpu"],
                            stdout=open(folder / "server.log", "w"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    for _ in range(600):
        if ready.exists():
            return proc, "127.0.0.1:" + ready.read_text().strip().rsplit(":", 1)[1]
        time.sleep(0.2)
    raise RuntimeError(f"the server did not start; see {folder / 'server.log'}")


def run_case(root: Path, case: str, rnd: int, model: Path, prompts: Path, rewards: Path,
             args: argparse.Namespace) -> dict[str, float]:
    from fsdpjob.orchestrator.core.jobspec.spec import JobSpec
    from fsdpjob.orchestrator.core.runfolder.paths import RunPaths
    from fsdpjob.orchestrator.core.runfolder.runmeta import RunMeta

    run_dir = root / f"{case}-{rnd}"
    run_dir.mkdir()
    RunMeta.of(JobSpec.model_validate(spec(case, model, prompts, rewards, args))).write(RunPaths(run_dir))
    server, env = None, {}
    if case == "server":
        server, address = start_server(model, run_dir)
        env["FSDPJOB_GENERATION_SERVER"] = address
    try:
        launch_ranks([*WORKER, str(run_dir)], 2, run_dir / "logs", timeout=1800, env=env)
    finally:
        if server is not None:
            os.killpg(server.pid, signal.SIGINT)  # the server stops on SIGINT (SIGTERM leaves it serving)
            server.wait(30)
    lines = [m for m in read_jsonl(run_dir / "metrics.jsonl") if "loss" in m]
    rows = []
    for before, m in zip(lines, lines[1:]):
        if m["step"] <= args.warmup:
            continue
        step_s = m["time"] - before["time"]
        tokens = m["completions/mean_length"] * 16  # 16 completions in the global step
        rows.append({"tokens_per_s": tokens / max(m["generation_s"], 1e-9), "step_s": step_s,
                     "generation": m["generation_s"] / step_s, "scoring": m["scoring_s"] / step_s})
    return {k: statistics.median(r[k] for r in rows) for k in rows[0]}


def write_prompts(root: Path, count: int) -> tuple[Path, Path]:
    prompts, rewards = root / "prompts.jsonl", root / "rewards.py"
    prompts.write_text("".join(json.dumps({"prompt": " ".join(line.split()[:10])}) + "\n"
                               for line in random_text(count, seed=3)))
    rewards.write_text(REWARDS)
    return prompts, rewards


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="1 round of 5 steps (a smoke run)")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.steps, args.warmup = 1, 5, 1
    cases = ["inprocess", "server"]
    with tempfile.TemporaryDirectory(prefix="fsdpjob-grpo-bench-") as tmp:
        root = Path(tmp)
        model, _ = make_assets(root, SIZE)
        prompts, rewards = write_prompts(root, 400)
        results: dict[str, list[dict]] = {c: [] for c in cases}
        for rnd in range(args.rounds):
            for case in cases[rnd % 2:] + cases[:rnd % 2]:
                results[case].append(run_case(root, case, rnd, model, prompts, rewards, args))
                print(f"round {rnd} {case}: {results[case][-1]}", flush=True)
    print(f"\n2 CPU ranks, gloo, fp32; {SIZE}; 16 completions x {NEW_TOKENS} new tokens per step; {args.rounds} "
          f"round(s) of {args.steps} steps, the first {args.warmup} left out; {load_note()}")
    for case in cases:
        med = {k: statistics.median(r[k] for r in results[case]) for k in results[case][0]}
        training = 1 - med["generation"] - med["scoring"]
        print(f"{case:10s} {med['tokens_per_s']:8,.0f} generated tokens/s  step {med['step_s']:.2f} s: generation "
              f"{med['generation']:.0%}, scoring {med['scoring']:.0%}, training {training:.0%}")


if __name__ == "__main__":
    main()
