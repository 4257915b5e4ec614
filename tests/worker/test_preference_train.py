"""Preference training end to end (jobs.train.run on 2 real gloo ranks, the local profile's way): DPO with the cached
reference pass, stopped and resumed in training and inside the pass, against one uninterrupted run, bitwise;
live against cached; LoRA; ORPO, and its own stop and resume. The data: 3-digit additions, the right sum
chosen over zeros."""

from __future__ import annotations

import json
import math
import random
import shutil
from pathlib import Path

import pytest
from distributed import committed_model_state, run_ranks, write_run
from distributed import train_worker as _worker

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

STEPS, STOP_AT = 16, 6
# The live reference run: its losses against the cached run's first 8 (constant lr: max_steps changes none).
LIVE_STEPS = 8


def write_pairs(path: Path, n: int, seed: int = 0) -> Path:
    rng = random.Random(seed)
    lines = []
    for _ in range(n):
        a, b = rng.randrange(100, 1000), rng.randrange(100, 1000)
        wrong = "0" * len(str(a + b))  # a pattern the tiny random model learns to avoid in a few steps
        lines.append(json.dumps({"prompt": f"{a}+{b}=", "chosen": str(a + b), "rejected": wrong}))
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> dict:
    from fsdpjob.jobs.quickstart import make_quickstart

    folder = tmp_path_factory.mktemp("assets")
    made = make_quickstart(folder)
    return {**made, "pairs": str(write_pairs(folder / "pairs.jsonl", 40))}


def make_run(root: Path, name: str, assets: dict, *, method: str = "dpo", options: dict | None = None,
             lora: bool = False, steps: int = STEPS, more: dict | None = None, resume_from: str | None = None) -> Path:
    spec = {
        "model": {"path": assets["model_path"], **({"lora": {"r": 4, "alpha": 8.0}} if lora else {})},
        "data": {"path": assets["pairs"], "seq_len": 16},
        # Global batch 4 pairs = 1 x 2 x 2 ranks.
        "train": {"max_steps": steps, "micro_batch_size": 1, "grad_accum_steps": 2, "lr": 2e-3, "log_every": 1,
                  "method": method, "lr_schedule": "constant"},
        "fsdp": {"mixed_precision": "fp32"},
        "checkpoint": {"interval_steps": 0, "interval_minutes": 0},
        **({method: options} if options is not None else {}),
    }
    for section, values in (more or {}).items():
        spec[section] = {**spec.get(section, {}), **values}
    return write_run(root, name, spec, resume_from=resume_from)


def train(run_dir: Path, world: int = 2, **env: str) -> list[int]:
    return run_ranks(_worker, world, run_dir=str(run_dir), env=env)


def metrics(run_dir: Path) -> dict[int, dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {m["step"]: m for m in map(json.loads, lines) if "loss" in m}


def events(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, assets) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("runs")
    full = make_run(root, "full", assets)
    assert train(full) == [0, 0]
    stopped = make_run(root, "stopped", assets)
    assert train(stopped, FSDPJOB_STOP_AT_STEP=str(STOP_AT)) == [0, 0]
    assert train(stopped) == [0, 0]
    in_pass = make_run(root, "in-pass", assets)
    assert train(in_pass, FSDPJOB_STOP_IN_REFERENCE="0") == [0, 0]  # 40 pairs: 3 chunks of 16 on 2 ranks
    assert train(in_pass) == [0, 0]
    live = make_run(root, "live", assets, options={"reference": "live"}, steps=LIVE_STEPS)
    assert train(live) == [0, 0]
    return {"full": full, "stopped": stopped, "in_pass": in_pass, "live": live}


@pytest.fixture(scope="module")
def orpo_full(tmp_path_factory, assets) -> Path:
    """One uninterrupted ORPO run, for the test that it trains and for the one that resumes a stop against it."""
    full = make_run(tmp_path_factory.mktemp("orpo"), "full", assets, method="orpo", steps=10)
    assert train(full) == [0, 0]
    return full


def test_dpo_starts_at_ln2_and_its_loss_falls_as_the_chosen_answers_win(runs):
    m = metrics(runs["full"])
    assert set(m) == set(range(1, STEPS + 1))
    # The policy is the reference at the first step: every log-ratio is 0, the sigmoid loss ln 2.
    assert m[1]["loss"] == pytest.approx(math.log(2), abs=1e-6), m[1]
    assert m[1]["rewards/chosen"] == pytest.approx(0, abs=1e-6)
    assert m[1]["rewards/margins"] == pytest.approx(0, abs=1e-6)
    first, last = sum(m[s]["loss"] for s in (1, 2, 3)) / 3, sum(m[s]["loss"] for s in range(STEPS - 2, STEPS + 1)) / 3
    assert last < first - 0.05, (first, last)
    assert sum(m[s]["rewards/accuracies"] for s in range(STEPS - 3, STEPS + 1)) / 4 >= 0.75, m
    for key in ("rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected"):
        assert all(math.isfinite(m[s][key]) for s in m), key
    passes = [e for e in events(runs["full"]) if e["event"] == "reference"]
    assert [p["phase"] for p in passes] == ["start", "done"] and passes[-1]["rows"] == 40, passes


def test_a_stop_in_training_resumes_bitwise(runs):
    full, stopped = metrics(runs["full"]), metrics(runs["stopped"])
    # The relaunch resumed at the stop (a silent restart from step 0 would give the same final bits)
    assert [e["step"] for e in events(runs["stopped"]) if e["event"] in ("stop", "resume")] == [STOP_AT, STOP_AT]
    # The test hook that stopped it is said at the start it was set for, and only there (issue 55)
    starts = [e.get("test_hooks") for e in events(runs["stopped"]) if e["event"] == "start"]
    assert starts == [{"FSDPJOB_STOP_AT_STEP": str(STOP_AT)}, None], starts
    assert [full[s]["loss"] for s in full] == [stopped[s]["loss"] for s in full]
    a, b = committed_model_state(runs["full"]), committed_model_state(runs["stopped"])
    assert all((a[k] == b[k]).all() for k in a)
    # The restart read the reference cache: no second pass.
    assert [p["phase"] for p in events(runs["stopped"]) if p["event"] == "reference"] == ["start", "done"]


def test_a_new_run_continues_a_stopped_dpo_run_from_its_step_folder_with_that_runs_reference(tmp_path, assets, runs):
    """`submit --resume-from <step folder of another run>`: the new run has no cache of its own and its model is
    trained already; it reads (and copies) the cache of the run that wrote the checkpoint, runs no pass, and
    trains the uninterrupted run's steps after the stop bitwise."""
    step_dir = runs["stopped"] / "checkpoints" / f"step-{STOP_AT:08d}"
    continued = make_run(tmp_path, "continued", assets, resume_from=str(step_dir))
    assert train(continued) == [0, 0]
    resume = next(e for e in events(continued) if e["event"] == "resume")
    assert resume["step"] == STOP_AT, resume
    full, after = metrics(runs["full"]), metrics(continued)
    assert sorted(after) == list(range(STOP_AT + 1, STEPS + 1)), sorted(after)
    assert [after[s]["loss"] for s in after] == [full[s]["loss"] for s in after]
    assert not [e for e in events(continued) if e["event"] == "reference"]  # no pass: the source run's cache
    [copied] = (continued / "reference").glob("*/complete.json")
    assert json.loads(copied.read_text())["copied_from"].startswith(str(runs["stopped"].resolve())), copied
    a, b = committed_model_state(runs["full"]), committed_model_state(continued)
    assert all((a[k] == b[k]).all() for k in a)


def test_a_new_run_from_a_step_folder_without_its_run_computes_the_reference_from_the_starting_weights(
        tmp_path, assets, runs):
    """The checkpoint alone (its run's folder gone or elsewhere): the pass runs again on a fresh copy of model.path,
    never on the trained weights the run resumes with, and the run trains the uninterrupted run's steps bitwise."""
    alone = tmp_path / "moved-checkpoint" / f"step-{STOP_AT:08d}"
    shutil.copytree(runs["stopped"] / "checkpoints" / f"step-{STOP_AT:08d}", alone)
    continued = make_run(tmp_path, "continued", assets, resume_from=str(alone))
    assert train(continued) == [0, 0]
    assert next(e for e in events(continued) if e["event"] == "resume")["step"] == STOP_AT
    passes = [e for e in events(continued) if e["event"] == "reference"]
    assert [(p["phase"], p.get("weights")) for p in passes] == [("start", "model.path"), ("done", "model.path")]
    full, after = metrics(runs["full"]), metrics(continued)
    assert sorted(after) == list(range(STOP_AT + 1, STEPS + 1)), sorted(after)
    assert [after[s]["loss"] for s in after] == [full[s]["loss"] for s in after]
    # The cache it wrote is the first run's (computed at step 0 from the same weights), row for row, bitwise.
    from fsdpjob.jobs.preference.reference import ReferenceCache

    [own] = (continued / "reference").glob("*/complete.json")
    first_run = runs["full"] / "reference" / own.parent.name
    mine, first = (ReferenceCache(folder, 40, 2) for folder in (own.parent, first_run))
    assert len(mine.load_written()) == len(first.load_written()) == 3
    assert mine.logps.abs().sum() > 0 and (mine.logps == first.logps).all()


def test_a_stop_inside_the_reference_pass_resumes_the_pass_and_ends_bitwise(runs):
    passes = [p for p in events(runs["in_pass"]) if p["event"] == "reference"]
    assert [p["phase"] for p in passes] == ["start", "stopped", "start", "done"], passes
    stop = next(e for e in events(runs["in_pass"]) if e["event"] == "stop")
    assert stop["step"] == 0, stop
    full, resumed = metrics(runs["full"]), metrics(runs["in_pass"])
    assert [full[s]["loss"] for s in full] == [resumed[s]["loss"] for s in full]
    a, b = committed_model_state(runs["full"]), committed_model_state(runs["in_pass"])
    assert all((a[k] == b[k]).all() for k in a)


def test_a_live_reference_gives_the_cached_losses(runs):
    cached, live = metrics(runs["full"]), metrics(runs["live"])
    assert sorted(live) == list(range(1, LIVE_STEPS + 1)), live
    for step in live:
        assert live[step]["loss"] == pytest.approx(cached[step]["loss"], rel=1e-5, abs=1e-6), step
    assert not [e for e in events(runs["live"]) if e["event"] == "reference"]  # no pass, no cache
    assert not (runs["live"] / "reference").exists()


def test_lora_dpo_uses_the_base_with_its_adapters_off_as_reference_and_orpo_trains(tmp_path, assets, orpo_full):
    lora = make_run(tmp_path, "lora", assets, lora=True, steps=10)
    assert train(lora) == [0, 0]
    m = metrics(lora)
    assert m[1]["loss"] == pytest.approx(math.log(2), abs=1e-6), m[1]  # LoRA's B starts at 0: the base
    assert m[10]["loss"] < m[1]["loss"], m
    orpo = orpo_full
    m = metrics(orpo)
    assert m[10]["loss"] < m[1]["loss"] and "rewards/accuracies" in m[10], m
    assert not (orpo / "reference").exists()  # ORPO needs no reference
    shutil.rmtree(tmp_path / "lora" / "checkpoints", ignore_errors=True)


def test_a_dpo_stop_on_2_ranks_resumes_on_1_with_the_reference_cache_it_wrote(tmp_path, assets, runs):
    """Resharding: the cache is keyed by pair, not by rank; one rank reads it and trains the same global batch
    (4 pairs: 1 x 2 x 2 ranks, then 1 x 4 x 1) to the same losses, within the reduction order's rounding. The
    straight run is the module's 16-step one: under a constant lr its first 8 steps are an 8-step run's."""
    moved = make_run(tmp_path, "moved", assets, steps=8)
    assert train(moved, FSDPJOB_STOP_AT_STEP="4") == [0, 0]
    assert train(moved, world=1) == [0]
    a, b = metrics(runs["full"]), metrics(moved)
    assert [b[s]["loss"] for s in range(1, 5)] == [a[s]["loss"] for s in range(1, 5)]  # the same run up to the stop
    for step in range(5, 9):
        assert b[step]["loss"] == pytest.approx(a[step]["loss"], rel=1e-5), step
    assert [p["phase"] for p in events(moved) if p["event"] == "reference"] == ["start", "done"]  # read, not redone
    resume = next(e for e in events(moved) if e["event"] == "resume")
    assert resume["world_size"] == 1 and resume["grad_accum_steps"] == 4, resume


def test_dpo_evaluates_on_its_eval_pairs_with_their_own_reference_and_keeps_the_best(tmp_path, assets):
    """Evaluation during preference training: eval_loss (the method's loss over the eval pairs) and the eval
    metrics under TRL's names every eval_every steps and at the end; the eval pairs' reference has its own cached
    pass before training; keep_best records eval_loss in each checkpoint."""
    evals = write_pairs(tmp_path / "eval.jsonl", 10, seed=5)  # 10 pairs on 2 ranks: 5 each, the last batch short
    run = make_run(tmp_path, "eval", assets, steps=8, more={
        "data": {"eval_path": str(evals)}, "train": {"eval_every": 4, "micro_batch_size": 2, "grad_accum_steps": 1},
        "checkpoint": {"keep_best": True, "interval_steps": 4}})
    assert train(run) == [0, 0]
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    evaluated = {m["step"]: m for m in lines if "eval_loss" in m}
    assert sorted(evaluated) == [4, 8], evaluated
    assert evaluated[8]["eval_loss"] < math.log(2) and evaluated[8]["eval_tokens"] == 10, evaluated
    assert 0 <= evaluated[8]["eval_rewards/accuracies"] <= 1 and "eval_rewards/margins" in evaluated[8]
    passes = [(e.get("table", "train"), e["phase"]) for e in events(run) if e["event"] == "reference"]
    assert passes == [("train", "start"), ("train", "done"), ("eval", "start"), ("eval", "done")], passes
    kinds = [e["event"] for e in events(run) if e["event"] in ("reference", "ready")]
    assert kinds[-1] == "ready", kinds
    facts = json.loads((run / "checkpoints" / "step-00000008" / "fsdpjob.json").read_text())
    assert facts["eval_loss"] == pytest.approx(evaluated[8]["eval_loss"]), facts


def test_an_orpo_stop_in_training_resumes_bitwise(tmp_path, assets, orpo_full):
    """ORPO has no reference: the resume is the weights, AdamW, schedule, data position and RNG alone."""
    full = orpo_full
    stopped = make_run(tmp_path, "stopped", assets, method="orpo", steps=10)
    assert train(stopped, FSDPJOB_STOP_AT_STEP="4") == [0, 0]
    assert max(metrics(stopped)) == 4
    assert train(stopped) == [0, 0]
    a, b = metrics(full), metrics(stopped)
    assert sorted(a) == sorted(b) == list(range(1, 11))
    for key in ("loss", "rewards/margins", "rewards/accuracies", "logps/chosen"):
        assert [a[s][key] for s in a] == [b[s][key] for s in a], key
    resume = next(e for e in events(stopped) if e["event"] == "resume")
    assert resume["step"] == 4, resume
    x, y = committed_model_state(full), committed_model_state(stopped)
    assert x.keys() == y.keys() and all((x[k] == y[k]).all() for k in x)
