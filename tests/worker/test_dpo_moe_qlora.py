"""DPO on the models of issue 56 (2 real gloo ranks, the local profile's way): a tiny Qwen3-MoE with LoRA's default
targets (the attention only: the router and the experts stay frozen), and the quickstart Llama on a 4-bit base
(model.quantize nf4), whose reference is the 4-bit base with the adapters off. At the first step the policy is that
reference (LoRA's B starts at 0): the sigmoid loss is ln 2 exactly, which a reference built from anything else
(the full-precision base) would not give; then the loss falls."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
from distributed import committed_model_state, run_ranks, train_worker, write_run
from families import save_tiny_family

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

STEPS = 8


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> dict:
    from test_preference_train import write_pairs

    from fsdpjob.jobs.quickstart import make_quickstart

    folder = tmp_path_factory.mktemp("assets")
    made = make_quickstart(folder)
    # The MoE model speaks the quickstart tokenizer's vocabulary and special ids.
    config = json.loads((Path(made["model_path"]) / "config.json").read_text())
    moe = folder / "qwen3_moe"
    save_tiny_family(moe, "qwen3_moe", vocab_size=config["vocab_size"], **{
        k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")})
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy2(Path(made["model_path"]) / name, moe / name)
    return {**made, "moe_path": str(moe), "pairs": str(write_pairs(folder / "pairs.jsonl", 24))}


def dpo(root: Path, name: str, model: dict, pairs: str) -> dict:
    """A DPO run with LoRA r 4 on ``model``: its metrics by step, and its folder under "run_dir"."""
    run_dir = write_run(root, name, {
        "model": {**model, "lora": {"r": 4, "alpha": 8.0}},
        "data": {"path": pairs, "seq_len": 16},
        "train": {"max_steps": STEPS, "micro_batch_size": 1, "grad_accum_steps": 2, "lr": 2e-3, "log_every": 1,
                  "method": "dpo", "lr_schedule": "constant"},
        "fsdp": {"mixed_precision": "fp32"},
        "checkpoint": {"interval_steps": 0, "interval_minutes": 0},
    })
    assert run_ranks(train_worker, 2, run_dir=str(run_dir), env={}) == [0, 0]
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {"run_dir": run_dir, **{m["step"]: m for m in map(json.loads, lines) if "loss" in m}}


def _starts_at_ln2_and_falls(m: dict) -> None:
    assert set(range(1, STEPS + 1)) <= set(m), m
    assert m[1]["loss"] == pytest.approx(math.log(2), abs=1e-6), m[1]  # the policy is the reference
    first, last = sum(m[s]["loss"] for s in (1, 2, 3)) / 3, sum(m[s]["loss"] for s in (6, 7, 8)) / 3
    assert last < first, (first, last)


def test_dpo_on_a_tiny_moe_trains_its_attention_adapters(tmp_path, assets):
    m = dpo(tmp_path, "moe", {"path": assets["moe_path"]}, assets["pairs"])
    _starts_at_ln2_and_falls(m)
    saved = committed_model_state(m["run_dir"])
    adapted = {k.split(".lora_")[0].rpartition(".")[2] for k in saved}
    assert adapted == {"q_proj", "k_proj", "v_proj", "o_proj"}, adapted  # the router and experts stay frozen


def test_dpo_on_a_4_bit_base_uses_it_with_the_adapters_off_as_reference(tmp_path, assets):
    m = dpo(tmp_path, "qlora", {"path": assets["model_path"], "quantize": "nf4"}, assets["pairs"])
    _starts_at_ln2_and_falls(m)
    passes = [json.loads(x) for x in (m["run_dir"] / "events.jsonl").read_text().splitlines()
              if json.loads(x)["event"] == "reference"]
    assert [p["phase"] for p in passes] == ["start", "done"] and passes[-1]["rows"] == 24, passes
