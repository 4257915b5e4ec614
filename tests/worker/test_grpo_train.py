"""GRPO end to end (jobs.train.run on 2 real gloo ranks, the local profile's way): a learnable reward rises; a stop
at step 10 resumed to 20 equals 20 straight, bitwise (weights and logged rewards), also in the middle of a round of
generations that two steps share (8 steps, stopped at 5); beta > 0 with LoRA (the base with its adapters off as
reference) runs and exports.

The reward: the share of a completion's characters that are digits. The quickstart tokenizer splits digits one by
one, so the random tiny model emits a few of them by chance (a signal in most groups) and learns to emit more."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from distributed import committed_model_state, run_ranks, write_run
from distributed import train_worker as _worker
from helpers import resumed_where_saved

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

STEPS, STOP_AT = 20, 10
TWO_STEPS, TWO_STOP_AT = 8, 5  # two steps per round: rounds 1-2, 3-4, 5-6, 7-8; a stop after 5 is inside one
REWARDS = '''
def digits(prompts, completions, **fields):
    return [sum(c.isdigit() for c in text) / max(len(text), 1) for text in completions]


def answer_seen(prompts, completions, answer, **fields):
    """Reads a field of the prompt's record (TRL's convention): 1 where the completion holds the answer."""
    return [float(a in text) for text, a in zip(completions, answer)]
'''


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> dict:
    from fsdpjob.jobs.quickstart import make_quickstart

    folder = tmp_path_factory.mktemp("assets")
    made = make_quickstart(folder)
    prompts = folder / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"count {i}:", "answer": str(i % 10)}) + "\n"
                               for i in range(64)))
    (folder / "rewards.py").write_text(REWARDS)
    return {**made, "prompts": str(prompts), "rewards": str(folder / "rewards.py")}


def make_run(root: Path, name: str, assets: dict, *, steps: int = STEPS, grpo: dict | None = None,
             lora: bool = False, more: dict | None = None) -> Path:
    spec = {
        "model": {"path": assets["model_path"], **({"lora": {"r": 4, "alpha": 8.0}} if lora else {})},
        "data": {"path": assets["prompts"], "seq_len": 24},
        # 8 completions per rank and step (2 prompts x 4), 16 in the global step.
        "train": {"max_steps": steps, "micro_batch_size": 4, "grad_accum_steps": 2, "lr": 3e-3, "log_every": 1,
                  "method": "grpo", "lr_schedule": "constant", "max_grad_norm": 1.0},
        "fsdp": {"mixed_precision": "fp32"},
        "checkpoint": {"interval_steps": 0, "interval_minutes": 0},
        "grpo": {"reward": [f"{assets['rewards']}:digits", {"function": f"{assets['rewards']}:answer_seen",
                                                           "weight": 0.5}],
                 "num_generations": 4, "max_new_tokens": 12, "temperature": 1.0, **(grpo or {})},
    }
    for section, values in (more or {}).items():
        spec[section] = {**spec.get(section, {}), **values}
    return write_run(root, name, spec)


def train(run_dir: Path, world: int = 2, **env: str) -> list[int]:
    return run_ranks(_worker, world, run_dir=str(run_dir), env=env, timeout=600)


def metrics(run_dir: Path) -> dict[int, dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {m["step"]: m for m in map(json.loads, lines) if "loss" in m}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, assets) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("runs")
    out = {}
    two = {"steps_per_generation": 2, "loss_type": "grpo"}
    for name, grpo, steps, stop in (("straight", None, STEPS, STOP_AT), ("two", two, TWO_STEPS, TWO_STOP_AT)):
        out[name] = make_run(root, name, assets, grpo=grpo, steps=steps)
        assert train(out[name]) == [0, 0]
        # Stopped at step 10 (with two steps per round, at step 5: inside a round) then resumed.
        stopped = make_run(root, f"{name}-stopped", assets, grpo=grpo, steps=steps)
        assert train(stopped, FSDPJOB_STOP_AT_STEP=str(stop)) == [0, 0]
        assert train(stopped) == [0, 0]
        out[f"{name}-stopped"] = stopped
    return out


def test_the_reward_rises_and_every_metric_has_trls_name(runs):
    m = metrics(runs["straight"])
    assert sorted(m) == list(range(1, STEPS + 1))
    first = sum(m[s]["reward"] for s in range(1, 6)) / 5
    last = sum(m[s]["reward"] for s in range(STEPS - 4, STEPS + 1)) / 5
    assert last >= 2 * first and last > 0, (first, last)
    for key in ("reward", "reward_std", "rewards/digits/mean", "rewards/digits/std", "rewards/answer_seen/mean",
                "completions/mean_length", "completions/min_length", "completions/max_length",
                "completions/clipped_ratio", "frac_reward_zero_std", "entropy", "clip_ratio", "loss", "grad_norm",
                "generation_s", "scoring_s"):
        assert key in m[STEPS], (key, m[STEPS])
    assert "kl" not in m[STEPS]  # beta 0: no reference, no kl
    assert 0 < m[1]["completions/min_length"] <= m[1]["completions/mean_length"] <= m[1]["completions/max_length"] <= 12
    assert 0 <= m[1]["completions/clipped_ratio"] <= 1 and 0 <= m[1]["frac_reward_zero_std"] <= 1
    assert m[1]["entropy"] > 0  # the sampled distribution's, per completion token
    # The weighted sum of the functions' means is the mean reward.
    assert m[3]["reward"] == pytest.approx(m[3]["rewards/digits/mean"] + 0.5 * m[3]["rewards/answer_seen/mean"],
                                           abs=1e-5)


@pytest.mark.parametrize("name", ["straight", "two"])
def test_a_stop_resumes_bitwise_weights_and_rewards(runs, name):
    straight, stopped = metrics(runs[name]), metrics(runs[f"{name}-stopped"])
    # The relaunch resumed at the stop: a silent restart from step 0 would end with the same bits.
    lines = [json.loads(x) for x in (runs[f"{name}-stopped"] / "events.jsonl").read_text().splitlines()]
    assert resumed_where_saved(lines, 1) == [{"straight": STOP_AT, "two": TWO_STOP_AT}[name]]
    for key in ("reward", "loss", "completions/mean_length", "entropy"):
        assert [straight[s][key] for s in straight] == [stopped[s][key] for s in straight], key
    a, b = committed_model_state(runs[name]), committed_model_state(runs[f"{name}-stopped"])
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)


def test_two_steps_per_generation_clip_against_the_generating_policy(runs):
    m = metrics(runs["two"])
    # The first step of each round trains on its own policy's completions: nothing clipped. Later steps may clip.
    assert sorted(m) == list(range(1, TWO_STEPS + 1))
    assert all(m[s]["clip_ratio"] == 0 for s in range(1, TWO_STEPS + 1, 2)), m
    stop = json.loads(next(x for x in (runs["two-stopped"] / "events.jsonl").read_text().splitlines()
                           if json.loads(x)["event"] == "stop"))
    assert stop["step"] == TWO_STOP_AT  # a stop between the two steps of a round: its second half was saved


def test_lora_grpo_with_a_kl_to_the_base_trains_and_exports(tmp_path, assets):
    run = make_run(tmp_path, "lora", assets, steps=6, lora=True, grpo={"beta": 0.04},
                   more={"checkpoint": {"export_final": True}})
    assert train(run) == [0, 0]
    m = metrics(run)
    assert m[1]["kl"] == pytest.approx(0, abs=1e-6)  # LoRA's B starts at 0: the policy is the base
    assert m[6]["kl"] >= 0 and all(m[s]["loss"] == m[s]["loss"] for s in m)
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in (run / "export").iterdir()}
