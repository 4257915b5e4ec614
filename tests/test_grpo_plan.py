"""The plan of a grpo job (issue 40 item 4): the reference model counted where beta > 0 on a full fine-tune, the KV
cache and sampling logits of in-process generation as their own moment, the step split between generation and
training; a server's generation leaves the training ranks no generation moment."""

from __future__ import annotations

from pathlib import Path

import pytest
from specs import plan_spec, write_config
from test_planner_savers import H100, LLAMA31_8B

from fsdpjob.orchestrator.planner.fit import make_plan
from fsdpjob.orchestrator.planner.resolve import resolve
from fsdpjob.orchestrator.views.plan import format_plan


def _plan(folder: Path, grpo: dict | None = None, **sections):
    model = {"activation_checkpointing": "full", **sections.pop("model", {})}
    resources = {"nodes": 2, **sections.pop("resources", {})}
    data = sections.pop("data", {"seq_len": 2048, "packing": False})
    spec = plan_spec(folder, data=data, model=model,
                     train={"method": "grpo", "micro_batch_size": 8, "grad_accum_steps": 2},
                     grpo={"reward": ["rewards:exact"], "num_generations": 8, "max_new_tokens": 1024, **(grpo or {})},
                     resources=resources, **sections)
    return make_plan(resolve(spec, H100))


def _moment(plan, name: str) -> dict[str, int]:
    return {i.name: i.bytes for i in next(m for m in plan.device.moments if m.name == name).items}


def test_generation_is_a_moment_with_its_kv_cache_and_the_step_is_split(tmp_path: Path) -> None:
    folder = write_config(tmp_path / "llama-3.1-8b", LLAMA31_8B)
    plan = _plan(folder)
    generation = _moment(plan, "generation (grpo)")
    # 16 completions x 2048 positions x 32 layers x (keys + values) x 8 KV heads x 128 dims x 2 bytes (bf16)
    assert generation["KV cache"] == 16 * 2048 * 32 * 2 * 8 * 128 * 2
    assert generation["sampling logits"] == 16 * LLAMA31_8B["vocab_size"] * 4 * 2
    t = plan.timing
    assert t.generation_s is not None and 0 < t.generation_s < t.step_s
    text = format_plan(plan)
    assert "generation (grpo)" in text and "step split (grpo): generation" in text
    assert plan.to_json()["step"]["generation_s"] == t.generation_s
    assert not [i for i in plan.device.state if i.name == "reference model (live)" and i.bytes]


def test_beta_keeps_a_frozen_reference_on_a_full_fine_tune_only_and_the_fix_is_beta_0(tmp_path: Path) -> None:
    folder = write_config(tmp_path / "llama-3.1-8b", LLAMA31_8B)
    plain, kl = _plan(folder), _plan(folder, grpo={"beta": 0.04})
    reference = {i.name: i.bytes for i in kl.device.state}["reference model (live)"]
    assert reference > 0 and kl.device.peak - plain.device.peak >= reference  # and its share of the slack
    lora = _plan(folder, grpo={"beta": 0.04}, model={"lora": {"r": 8}})
    assert {i.name: i.bytes for i in lora.device.state}["reference model (live)"] == 0  # the base, adapters off
    # At seq 3584 on one node the plan fits without the reference, not with it: dropping the KL is a fix, and a
    # smaller micro-batch keeps every rank's 16 completions whole groups of 8 (8 -> 4 x 4, never 7 x 3).
    fits, tight = (_plan(folder, grpo={"beta": beta}, data={"seq_len": 3584, "packing": False},
                         resources={"nodes": 1}) for beta in (0.0, 0.04))
    assert fits.fits and not tight.fits
    changes = [f.change for f in tight.fixes]
    assert "grpo.beta=0" in changes, changes
    assert [c for c in changes if c.startswith("train.micro_batch_size")] == [
        "train.micro_batch_size=4 train.grad_accum_steps=4"], changes


def test_a_generation_server_takes_the_generation_off_the_training_ranks(tmp_path: Path) -> None:
    folder = write_config(tmp_path / "llama-3.1-8b", LLAMA31_8B)
    plan = _plan(folder, grpo={"generator": {"backend": "vllm", "nodes": 1}}, resources={"nodes": 3})
    assert not [m for m in plan.device.moments if m.name == "generation (grpo)"]
    # the step waits on the server's round and its weight sync, spread over the round's steps
    g = plan.generator
    assert plan.timing.generation_s == pytest.approx(g.round_s + g.sync_s) and g.round_s > 0
    # the server's node does not train: 2 nodes x 8 ranks shard the policy (issue 52 item 7)
    assert (plan.setup.world, plan.setup.shard_degree, plan.generator.trainer_ranks) == (16, 16, 16)
