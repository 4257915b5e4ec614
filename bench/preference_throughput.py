"""DPO's throughput against fsdpjob's SFT on the same model, ranks and rows; the reference pass timed on its own.

    python bench/preference_throughput.py [--rounds 3] [--steps 30] [--warmup 5] [--seq-len 128] [--quick]

Every case is jobs.train.run on 2 local CPU ranks over gloo (launched as torchrun would), on one random Llama
(bench/common.py) and one set of pairs made from random text: a prompt (the first half of a line), the chosen
answer (its second half), the rejected answer (another line's second half). Each row is prompt + answer,
right-padded to --seq-len, fp32, AdamW, constant LR:

- ``sft``: supervised fine-tuning on every answer of the pairs as its own prompt/completion example (chosen and
  rejected alike), unpacked, 4 rows per micro-batch: the same rows, token for token, that DPO's forwards see;
- ``dpo-cached``: DPO with ``reference: cached``, 2 pairs (4 rows) per micro-batch; the reference pass runs before
  the first step and is timed apart (its ``reference`` event's seconds), not in the steps' throughput;
- ``dpo-live``: DPO with ``reference: live``: a frozen second model runs a forward of every micro-batch.

The figure: processed tokens/s (non-pad positions of both answers, metrics.jsonl's tokens_per_s) over the steps
after --warmup, median over rounds; cases alternate within each round. Ratios are to ``sft`` of the same round
set. Nothing is asserted (target in issue 39: dpo-cached >= 0.9x sft).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ModelSize, launch_ranks, load_note, make_assets, random_text, read_jsonl

SIZE = ModelSize(vocab=2048, hidden=256, intermediate=688, layers=4, heads=4, kv_heads=2)
WORKER = ["-c", "import sys; from fsdpjob.jobs.train import run; run(sys.argv[1])"]


def write_data(root: Path, pairs: int) -> tuple[Path, Path]:
    """The pairs (prompt/chosen/rejected) and the same answers as SFT prompt/completion examples."""
    rng = random.Random(1)
    lines = random_text(2 * pairs, seed=7)
    rows, sft = [], []
    for i in range(pairs):
        words = lines[i].split()
        half = max(1, len(words) // 2)  # at most 12 words each: a row's prompt + answer fits 128 tokens
        prompt, chosen = " ".join(words[:half][:12]) + " ", " ".join(words[half:][:12]) or "x"
        other = lines[pairs + rng.randrange(pairs)].split()
        rejected = " ".join(other[len(other) // 2:][:12]) or "y"
        rows.append({"prompt": prompt, "chosen": chosen, "rejected": rejected})
        sft += [{"prompt": prompt, "completion": chosen}, {"prompt": prompt, "completion": rejected}]
    pair_file, sft_file = root / "pairs.jsonl", root / "sft.jsonl"
    pair_file.write_text("".join(json.dumps(r) + "\n" for r in rows))
    sft_file.write_text("".join(json.dumps(r) + "\n" for r in sft))
    return pair_file, sft_file


def spec(case: str, model: Path, pairs: Path, sft: Path, args: argparse.Namespace) -> dict:
    base = {"name": case, "model": {"path": str(model)},
            "train": {"max_steps": args.steps, "lr": 1e-4, "lr_schedule": "constant", "log_every": 1},
            "fsdp": {"mixed_precision": "fp32"}, "checkpoint": {"interval_minutes": 0}}
    if case == "sft":
        base["data"] = {"path": str(sft), "seq_len": args.seq_len, "packing": False, "prompt_field": "prompt",
                        "completion_field": "completion", "shuffle": False}
        base["train"]["micro_batch_size"] = 4
    else:
        base["data"] = {"path": str(pairs), "seq_len": args.seq_len, "shuffle": False}
        base["train"].update(method="dpo", micro_batch_size=2)
        base["dpo"] = {"reference": case.removeprefix("dpo-")}
    return base


def run_case(root: Path, case: str, rnd: int, model: Path, pairs: Path, sft: Path,
             args: argparse.Namespace) -> tuple[float, float | None]:
    from fsdpjob.orchestrator.core.jobspec.spec import JobSpec
    from fsdpjob.orchestrator.core.runfolder.paths import RunPaths
    from fsdpjob.orchestrator.core.runfolder.runmeta import RunMeta

    run_dir = root / f"{case}-{rnd}"
    run_dir.mkdir()
    RunMeta.of(JobSpec.model_validate(spec(case, model, pairs, sft, args))).write(RunPaths(run_dir))
    launch_ranks([*WORKER, str(run_dir)], 2, run_dir / "logs", timeout=1800)
    steps = [m for m in read_jsonl(run_dir / "metrics.jsonl") if "tokens_per_s" in m and m["step"] > args.warmup]
    rate = statistics.median(m["tokens_per_s"] for m in steps)
    events = read_jsonl(run_dir / "events.jsonl")
    passes = [e["seconds"] for e in events if e["event"] == "reference" and e.get("phase") == "done"]
    return rate, (passes[0] if passes else None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--pairs", type=int, default=480)
    parser.add_argument("--quick", action="store_true", help="1 round of 12 steps, 160 pairs (a smoke run)")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.steps, args.warmup, args.pairs = 1, 12, 3, 160
    cases = ["sft", "dpo-cached", "dpo-live"]
    with tempfile.TemporaryDirectory(prefix="fsdpjob-pref-bench-") as tmp:
        root = Path(tmp)
        model, _ = make_assets(root, SIZE)
        pairs, sft = write_data(root, args.pairs)
        rates: dict[str, list[float]] = {c: [] for c in cases}
        passes: list[float] = []
        for rnd in range(args.rounds):
            for case in cases[rnd % len(cases):] + cases[:rnd % len(cases)]:
                rate, took = run_case(root, case, rnd, model, pairs, sft, args)
                rates[case].append(rate)
                if took is not None:
                    passes.append(took)
                said = f", reference pass {took:.2f} s" if took else ""
                print(f"round {rnd} {case}: {rate:,.0f} tokens/s{said}", flush=True)
    sft_rate = statistics.median(rates["sft"])
    print(f"\n2 CPU ranks, gloo, fp32; {SIZE}; seq_len {args.seq_len}, 4 rows per micro-batch, {args.pairs} pairs; "
          f"{args.rounds} round(s) of {args.steps} steps, the first {args.warmup} left out; {load_note()}")
    for case in cases:
        median = statistics.median(rates[case])
        print(f"{case:11s} {median:10,.0f} tokens/s  {median / sft_rate:5.2f}x sft")
    if passes:
        print(f"reference pass ({args.pairs} pairs, {2 * args.pairs} rows): median {statistics.median(passes):.2f} s")


if __name__ == "__main__":
    main()
