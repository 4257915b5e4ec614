"""Real (non-pad) tokens/s on variable-length chat data: fsdpjob's default spec against TRL's SFTTrainer and HF Trainer.

    python bench/chat_throughput.py [--rounds 2] [--steps 20] [--warmup 5] [--seq-len 512] [--micro-batch 2]
        [--cases fsdpjob trl-packing trl-padding-free hf-padding] [--fsdpjob-cli PATH] [--quick]
        [--py-spy DIR] [--json FILE] [--workdir DIR]

The data: a chat JSONL (``{"messages": [{"role": "user", ...}, {"role": "assistant", ...}]}``, the format the
worker reads with ``data.messages_field``), made of bench/common.py's random words, whose token lengths (the
chat template's rendering with the tokenizer bench/common.py builds as the quickstart does) are drawn log-normal
(seeded; median ``seq_len / 6``, sigma 1.0: a long tail, as real SFT sets have) and clipped at ``seq_len``; the
user turn takes 15-50 % of each. The model: a random Llama (vocab 2048, hidden 256, 4 layers) saved with
save_pretrained, no downloads. Every case is a separate launch of 2 local CPU ranks over gloo on FSDP2, fp32
(FSDP2 forced on for the Trainers, as bench/hf_trainer.py does: on a CPU host accelerate would run DDP), AdamW,
clip 1.0, constant LR, sdpa attention, data shuffled with each framework's own seeded default:

- ``fsdpjob``: ``fsdpjob submit --profile local --wait`` with the default spec but for the shape: the default
  ``data.packing: true`` (whole examples into rows of seq_len by best-fit decreasing, attention within each
  example), ``micro_batch_size`` rows per rank, ``fsdp.mixed_precision: fp32`` (the Trainers' fp32), constant LR;
- ``trl-packing``: ``SFTTrainer`` with ``packing=True, max_length=seq_len`` (best-fit decreasing; TRL then feeds
  a micro-batch's rows flattened into one row with position_ids, padding-free), ``micro_batch`` rows per device;
- ``trl-padding-free``: ``SFTTrainer`` with ``padding_free=True``, no packing: K examples per device flattened;
- ``hf-padding``: ``Trainer`` with ``DataCollatorForLanguageModeling``: K examples per device padded to the
  longest of the micro-batch.

Same real tokens per step: the packed cases take ``micro_batch`` rows of seq_len per rank; K is chosen so that K
examples hold as many tokens on average: K = round(micro_batch x seq_len x E / mean length), E the best-fit
packing's fill of this data (jobs.data.best_fit_rows, the worker's packer). Each case's real tokens per timed step
are measured (fsdpjob: metrics.jsonl's tokens_per_s times each logged window; the Trainers: the non-pad positions
of each batch the model gets, bench/chat_trainers.py) and printed beside the rates, so any mismatch shows.

The figure: real tokens over the steps after the warm-up divided by their wall time (rank 0's step-end stamps),
median over rounds; also per CPU-second of both ranks (bench/worker_throughput.py's /proc sampling, steadier on
a shared machine). fsdpjob logs every gcd(warmup, 10) steps (its default 10 where it divides the warm-up).
Cases rotate within each round. Ratios fsdpjob / each baseline are of the medians, and per round. Nothing is
asserted (target in issue 36 item 13: fsdpjob >= 1.0x TRL and > HF Trainer).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

import worker_throughput as wt  # noqa: E402
from common import ModelSize, free_port, job_spec, load_note, make_assets, random_text, read_jsonl  # noqa: E402

fmt, median = wt.fmt, wt.median

SIZE = ModelSize(vocab=2048, hidden=256, intermediate=688, layers=4, heads=4, kv_heads=2)
QUICK_SIZE = ModelSize(vocab=512, hidden=48, intermediate=128, layers=2, heads=4, kv_heads=2)
CASES = {
    "fsdpjob": "fsdpjob submit --profile local --wait (default spec: boundary-aware packing)",
    "trl-packing": "TRL SFTTrainer, packing=True (bfd, padding-free rows)",
    "trl-padding-free": "TRL SFTTrainer, padding_free=True, no packing",
    "hf-padding": "HF Trainer, DataCollatorForLanguageModeling (padded to the micro-batch's longest)",
}
RANKS = 2


@dataclass
class Result:
    case: str
    round: int
    rate: float | None = None  # real tokens/s over the timed steps
    cpu_rate: float | None = None  # real tokens per CPU-second of both ranks
    real_per_step: float | None = None  # mean real tokens per timed step (all ranks)
    positions_per_step: float | None = None  # mean input positions per timed step, padding included
    loss1: float | None = None
    start_s: float | None = None  # launch to the end of step 1
    wall_s: float | None = None
    load: float = 0.0
    info: dict = field(default_factory=dict)
    note: str | None = None
    error: str | None = None


# ------------------------------------------------------------------------------------------------
# The data.


def word_pool(tokenizer, seed: int) -> tuple[list[str], list[int]]:
    """Random words (bench/common.py's Zipf lexicon) and each one's tokens after a space: the byte-level BPE
    splits text at spaces first, so a text's tokens are the sum of its words' (exactly, but for its first word)."""
    words = " ".join(random_text(800, seed=seed)).split()
    counts = [len(ids) for ids in tokenizer([" " + w for w in words], add_special_tokens=False)["input_ids"]]
    return words, counts


def chat_lengths(n: int, seq_len: int, seed: int, *, sigma: float = 1.0, floor: int = 16) -> list[int]:
    """Log-normal token lengths (median seq_len / 6), clipped to [floor, seq_len]."""
    import random

    rng = random.Random(seed)
    return [min(seq_len, max(floor, round(rng.lognormvariate(math.log(seq_len / 6), sigma)))) for _ in range(n)]


def _take(words: list[str], counts: list[int], cursor: int, budget: int) -> tuple[str, int]:
    taken, used = [], 0
    while used < max(budget, 1):
        i = cursor % len(words)
        taken.append(words[i])
        used, cursor = used + counts[i], cursor + 1
    return " ".join(taken), cursor


def write_chat(path: Path, tokenizer, n: int, seq_len: int, seed: int = 0) -> list[int]:
    """n two-turn conversations whose rendered token lengths follow chat_lengths; returns the lengths."""
    import random

    rng = random.Random(seed + 1)
    words, counts = word_pool(tokenizer, seed)
    overhead = len(render(tokenizer, [{"role": "user", "content": ""}, {"role": "assistant", "content": ""}]))
    cursor, records, lengths = 0, [], []
    for target in chat_lengths(n, seq_len, seed):
        body = max(2, target - overhead)
        user_share = round(body * rng.uniform(0.15, 0.5))
        user, cursor = _take(words, counts, cursor, user_share)
        reply, cursor = _take(words, counts, cursor, body - user_share)
        messages = [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]
        while len(ids := render(tokenizer, messages)) > seq_len:  # the clip: drop the reply's last words
            messages[1]["content"] = messages[1]["content"].rsplit(" ", 1)[0]
        records.append({"messages": messages})
        lengths.append(len(ids))
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return lengths


def render(tokenizer, messages: list[dict]) -> list[int]:
    """The conversation's ids as the worker tokenizes it (the chat template's text, no special tokens added)."""
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def batch_shape(lengths: list[int], seq_len: int, rows: int) -> dict:
    """The best-fit packing's fill of these lengths and the examples per device that match ``rows`` packed rows."""
    from fsdpjob.jobs.data import best_fit_rows

    packed = best_fit_rows(lengths, seq_len)
    fill = sum(lengths) / (len(packed) * seq_len)
    mean = statistics.fmean(lengths)
    return {"fill": fill, "mean_length": mean, "examples": max(1, round(rows * seq_len * fill / mean)),
            "packed_rows": len(packed), "examples_total": len(lengths), "max_length": max(lengths),
            "median_length": statistics.median(lengths)}  # fmt: skip


# ------------------------------------------------------------------------------------------------
# The cases.


@dataclass
class Setup:
    root: Path
    model: Path
    data: Path
    cli: Path
    seq_len: int
    rows: int  # packed rows per rank per step
    examples: int  # examples per rank per step, unpacked cases
    steps: int
    warmup: int
    timeout: float
    py_spy: Path | None


def log_every(warmup: int) -> int:
    return math.gcd(warmup, wt.default_log_every())  # the warm-up's last step is logged


def fsdpjob_command(setup: Setup, out: Path) -> tuple[list[str], dict[str, str]]:
    import yaml

    spec = job_spec("chat-throughput", setup.model, setup.data, seq_len=setup.seq_len, micro_batch=setup.rows,
                    max_steps=setup.steps, resources={"tasks_per_node": RANKS},
                    fsdp={"mixed_precision": "fp32", "collective_timeout_s": 180},
                    train={"log_every": log_every(setup.warmup)})  # fmt: skip
    spec["model"]["dtype"] = "float32"
    spec["data"] = {"path": str(setup.data), "messages_field": "messages", "seq_len": setup.seq_len}  # defaults
    (out / "spec.yaml").write_text(yaml.safe_dump(spec, sort_keys=False), encoding="utf-8")
    cmd = [str(setup.cli), "submit", str(out / "spec.yaml"), "--profile", "local", "--wait",
           "--run-dir", str(out / "run")]  # fmt: skip
    return cmd, wt.clean_env(FSDPJOB_HOME=str(setup.root / "fsdpjob-home"))


def trainer_command(setup: Setup, case: str, out: Path) -> tuple[list[str], dict[str, str]]:
    torchrun = Path(sys.executable).with_name("torchrun")
    launcher = [str(torchrun)] if torchrun.exists() else [sys.executable, "-m", "torch.distributed.run"]
    batch = setup.rows if case == "trl-packing" else setup.examples
    cmd = [*launcher, "--nproc-per-node", str(RANKS), "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
           str(BENCH / "chat_trainers.py"), "--case", case, "--model", str(setup.model), "--data", str(setup.data),
           "--seq-len", str(setup.seq_len), "--micro-batch", str(batch), "--steps", str(setup.steps),
           "--force-fsdp2", "--out", str(out / "times.json")]  # fmt: skip
    return cmd, wt.clean_env(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
                          HF_DATASETS_CACHE=str(out / "datasets-cache"))  # fmt: skip


def fsdpjob_outcome(out: Path, setup: Setup) -> tuple[dict[int, float], dict[int, float], float, dict]:
    """Step-end stamps of the logged steps, the real tokens of each logged window (tokens_per_s x the window's
    wall time: the worker's count of non-pad positions), step 1's loss and the data event's packing facts."""
    metrics = [m for m in read_jsonl(out / "run" / "metrics.jsonl") if "tokens_per_s" in m]
    ends = {m["step"]: m["time"] for m in metrics}
    windows = {b["step"]: b["tokens_per_s"] * (b["time"] - a["time"]) for a, b in zip(metrics, metrics[1:])}
    data = next((e for e in read_jsonl(out / "run" / "events.jsonl") if e.get("event") == "data"), {})
    info = {k: data[k] for k in ("packing_efficiency", "sequences", "examples") if k in data}
    return ends, windows, metrics[0]["loss"], info


def trainer_outcome(out: Path) -> tuple[dict[int, float], dict[int, float], float, dict, dict[int, float]]:
    record = json.loads((out / "times.json").read_text())
    ends = dict(enumerate(record["times"]))  # 0: on_train_begin
    real = {i + 1: float(n) for i, n in enumerate(record["real_tokens"])}
    positions = {i + 1: float(n) for i, n in enumerate(record["positions"])}
    return ends, real, record["losses"][0][1], record.get("info", {}), positions


def measure(result: Result, setup: Setup, case: str, out: Path, started: float, watcher) -> None:
    steps, warmup = setup.steps, setup.warmup
    if case == "fsdpjob":
        ends, real, result.loss1, info = fsdpjob_outcome(out, setup)
        positions = {s: float(RANKS * setup.rows * setup.seq_len) for s in range(1, steps + 1)}
    else:
        ends, real, result.loss1, info, positions = trainer_outcome(out)
    result.info.update(info)
    if max(ends) != steps or warmup not in ends:
        raise RuntimeError(f"{out}: step-end time stamps {sorted(ends)[:3]}...{max(ends)}, not up to {steps}")
    timed = [s for s in real if warmup < s <= steps]
    tokens = sum(real[s] for s in timed)
    result.rate = tokens / (ends[steps] - ends[warmup])
    result.real_per_step = tokens / (steps - warmup)
    result.positions_per_step = sum(positions[s] for s in range(warmup + 1, steps + 1)) / (steps - warmup)
    result.start_s = ends[1] - started if 1 in ends else None
    used = watcher.between(ends[warmup], ends[steps])
    if used and used["cpu"] > 0:
        result.cpu_rate = tokens / used["cpu"]


def run_case(setup: Setup, case: str, rnd: int, attempt: int = 1) -> Result:
    result = Result(case, rnd, load=os.getloadavg()[0])
    out = setup.root / "runs" / f"r{rnd}-{case}{'' if attempt == 1 else f'-{attempt}'}"
    out.mkdir(parents=True)
    cmd, env = fsdpjob_command(setup, out) if case == "fsdpjob" else trainer_command(setup, case, out)
    try:
        returncode, started, result.wall_s, watcher = wt.launch(cmd, env, out, fsdpjob=case == "fsdpjob",
                                                              timeout=setup.timeout, py_spy=setup.py_spy)  # fmt: skip
        if watcher.environments:
            result.info["workers"] = watcher.environments
        result.note = wt.exit_note(case, out, cmd, returncode)
        measure(result, setup, case, out, started, watcher)
    except (RuntimeError, OSError, KeyError, ValueError, IndexError, subprocess.TimeoutExpired) as exc:
        result.error = str(exc)
    return result


# ------------------------------------------------------------------------------------------------
# Report.


def report(results: list[Result], cases: list[str], shape: dict, setup: Setup) -> None:
    def med(case: str, key: str = "rate") -> float | None:
        return median([getattr(r, key) for r in results if r.case == case and getattr(r, key) is not None])

    def ratio(a: float | None, b: float | None) -> float | None:
        return a / b if a and b else None

    print(f"\n== chat data: {shape['examples_total']} conversations, token lengths median {shape['median_length']:.0f},"
          f" mean {shape['mean_length']:.1f}, max {shape['max_length']} (clipped at seq_len {setup.seq_len}); "
          f"best-fit fill {shape['fill']:.3f} ==")  # fmt: skip
    print(f"{RANKS} ranks; packed cases {setup.rows} rows x {setup.seq_len} per rank per step, unpacked cases "
          f"{setup.examples} examples per rank per step; steps {setup.warmup + 1}-{setup.steps} timed")
    print(f"{'case':<17} {'real tok/s':>10} {'fsdpjob/':>8} {'tok/CPU-s':>9} {'fsdpjob/':>8} {'real/step':>9} "
          f"{'pos/step':>8} {'loss@1':>7} {'start s':>7}  runs: real tok/s")  # fmt: skip
    for case in cases:
        runs = [r for r in results if r.case == case]
        per_run = ", ".join("FAIL" if r.rate is None else f"{r.rate:.0f}" for r in runs)
        print(f"{case:<17} {fmt(med(case), '.0f'):>10} {fmt(ratio(med('fsdpjob'), med(case)), '.2f'):>8} "
              f"{fmt(med(case, 'cpu_rate'), '.0f'):>9} "
              f"{fmt(ratio(med('fsdpjob', 'cpu_rate'), med(case, 'cpu_rate')), '.2f'):>8} "
              f"{fmt(med(case, 'real_per_step'), '.0f'):>9} {fmt(med(case, 'positions_per_step'), '.0f'):>8} "
              f"{fmt(med(case, 'loss1'), '.3f'):>7} {fmt(med(case, 'start_s'), '.1f'):>7}  {per_run}")  # fmt: skip
    for other in (c for c in cases if c != "fsdpjob" and "fsdpjob" in cases):
        rounds = sorted({r.round for r in results})
        pairs = [(next((r.rate for r in results if (r.case, r.round) == ("fsdpjob", n)), None),
                  next((r.rate for r in results if (r.case, r.round) == (other, n)), None)) for n in rounds]
        per_round = ", ".join(fmt(ratio(a, b), ".2f") for a, b in pairs)
        print(f"fsdpjob / {other}: {fmt(ratio(med('fsdpjob'), med(other)), '.2f')} (tok/s medians), "
              f"{fmt(ratio(med('fsdpjob', 'cpu_rate'), med(other, 'cpu_rate')), '.2f')} (tok/CPU-s); per round "
              f"{per_round}")  # fmt: skip
    for r in results:
        if r.info.get("wrapped_model_type") and r.round == 1:
            i = r.info
            print(f"  {r.case}: accelerate {i['accelerate_distributed_type']}, model wrapped as "
                  f"{i['wrapped_model_type']}, {i['dtensor_params']}/{i['param_tensors']} parameters DTensors")
    fsdp = next((r.info for r in results if r.case == "fsdpjob" and "packing_efficiency" in r.info), None)
    if fsdp:
        print(f"  fsdpjob's data event: packing_efficiency {fsdp['packing_efficiency']}")
    loads = [r.load for r in results]
    print(f"load average (1 min) at the launches: min {min(loads):.1f}, median {statistics.median(loads):.1f}, "
          f"max {max(loads):.1f} on {os.cpu_count()} CPUs")
    for r in results:
        if r.error or r.note:
            print(f"{'FAILED' if r.error else 'NOTE'} {r.case} round {r.round}: {r.error or r.note}")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--micro-batch", type=int, default=2, help="packed rows of seq_len per rank per step")
    parser.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES))
    parser.add_argument("--fsdpjob-cli", type=Path, help="the fsdpjob executable (default: this checkout's venv)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per run")
    parser.add_argument("--quick", action="store_true", help="1 round of 4 steps (2 warm-up), seq 128, a 0.1M model")
    parser.add_argument("--py-spy", type=Path, help="record every run with py-spy into this folder (perturbs rates)")
    parser.add_argument("--workdir", type=Path, help="keep models, data, specs, logs and run folders here")
    parser.add_argument("--json", type=Path, help="write every run's figures here (after each run)")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.steps, args.warmup, args.seq_len = 1, 4, 2, 128
    if not 1 <= args.warmup < args.steps:
        parser.error("--warmup must be at least 1 and below --steps")
    if args.fsdpjob_cli is None:
        here = REPO / ".venv" / "bin" / "fsdpjob"
        args.fsdpjob_cli = here if here.exists() else Path(shutil.which("fsdpjob") or here)
    if "fsdpjob" in args.cases and not args.fsdpjob_cli.is_file():
        parser.error(f"no fsdpjob executable at {args.fsdpjob_cli}; pass --fsdpjob-cli")
    return args


def prepare(args, root: Path) -> tuple[Setup, dict]:
    from transformers import AutoTokenizer

    model, _ = make_assets(root, QUICK_SIZE if args.quick else SIZE)
    tokenizer = AutoTokenizer.from_pretrained(model)
    # Enough conversations for every case's steps within one epoch, with a margin for the packing's fill.
    n = math.ceil(1.6 * RANKS * args.micro_batch * args.seq_len * args.steps / (args.seq_len / 6 * math.exp(0.5)))
    lengths = write_chat(root / "chat.jsonl", tokenizer, n, args.seq_len)
    shape = batch_shape(lengths, args.seq_len, args.micro_batch)
    setup = Setup(root, model, root / "chat.jsonl", args.fsdpjob_cli.resolve(), args.seq_len, args.micro_batch,
                  shape["examples"], args.steps, args.warmup, args.timeout, args.py_spy)  # fmt: skip
    return setup, shape


def main() -> int:
    args = parse_args()
    print(f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; {wt.versions()}; {load_note()}")
    if "fsdpjob" in args.cases:
        print(f"fsdpjob: {wt.inspect_checkout(args.fsdpjob_cli.resolve())[0]}")
    with tempfile.TemporaryDirectory(prefix="fsdpjob-chat-") as tmp:
        root, args.py_spy = wt.work_folders(args.workdir or Path(tmp), args.py_spy)
        setup, shape = prepare(args, root)
        print(f"data: {json.dumps(shape)}; {args.rounds} round(s) x {args.cases}; work folder {root}", flush=True)
        results = []
        for rnd in range(1, args.rounds + 1):
            for case in wt.rotated(list(args.cases), rnd - 1):
                result = wt.once_more(functools.partial(run_case, setup, case, rnd))
                results.append(result)
                print(f"  round {rnd} {case:<17} {fmt(result.rate, '8.0f')} real tok/s  "
                      f"{fmt(result.real_per_step, '.0f')} real/step  loss@1 {fmt(result.loss1, '.3f')}  "
                      f"wall {fmt(result.wall_s, '.0f')} s  load {result.load:.1f}"
                      f"{'  FAILED' if result.error else ''}", flush=True)  # fmt: skip
                if args.json:
                    args.json.write_text(json.dumps({"shape": shape, "results": [asdict(r) for r in results]},
                                                    indent=1), encoding="utf-8")  # fmt: skip
        report(results, list(args.cases), shape, setup)
    print(load_note())
    return 1 if any(r.error for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
