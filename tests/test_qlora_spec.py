"""model.quantize (QLoRA, issue 56) at validate and in the plan: refused in one line where it cannot work; the plan
holds the 4-bit weights at NF4's 0.52 bytes and adds the dequantization of the largest weight."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from fsdpjob.orchestrator.core.jobspec.spec import JobSpec

LLAMA2_7B = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 32000, "hidden_size": 4096,
             "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32,
             "num_key_value_heads": 32, "torch_dtype": "bfloat16"}


def _spec(model: dict, **more) -> JobSpec:
    return JobSpec.model_validate({"name": "q", "model": {"path": "/m", **model},
                                   "data": {"path": "/d.jsonl", "seq_len": 2048}, "train": {"max_steps": 10}, **more})


@pytest.mark.parametrize(("model", "more", "field", "says"), [
    ({"quantize": "nf4"}, {}, "quantize", "quantize nf4 holds a frozen base in 4 bits for LoRA adapters (QLoRA); "
                                          "add model.lora or drop model.quantize"),
    ({"quantize": "nf4", "lora": {}, "compile": True}, {}, "compile", "compile with quantize nf4 is not supported"),
    ({"quantize": "nf4", "lora": {}}, {"fsdp": {"replicate_degree": 2}, "resources": {"tasks_per_node": 2}},
     "model.quantize", "quantize nf4 shards on a 1-D mesh only"),
    ({"quantize": "nf4", "lora": {}}, {"train": {"max_steps": 10, "method": "grpo"},
                                       "grpo": {"reward": ["r.py:f"]}, "data": {"path": "/d.jsonl", "seq_len": 64,
                                                                                "prompt_field": "prompt"}},
     "model.quantize", "grpo with a 4-bit base is not supported in this version"),
])
def test_quantize_is_refused_where_it_cannot_work(model, more, field, says) -> None:
    with pytest.raises(ValidationError) as caught:
        _spec(model, **more)
    (error,) = caught.value.errors()
    assert error["ctx"]["field"] == field and says in error["msg"], error


def test_quantize_takes_nf4_only() -> None:
    with pytest.raises(ValidationError, match="nf4"):
        _spec({"quantize": "nf8", "lora": {}})


def test_quantize_is_in_the_fingerprint_and_leaves_older_hashes_alone() -> None:
    plain, four_bit = _spec({"lora": {}}), _spec({"lora": {}, "quantize": "nf4"})
    assert "model.quantize" not in plain.model_fingerprint()
    assert four_bit.model_fingerprint()["model.quantize"] == "nf4"
    assert plain.spec_hash() != four_bit.spec_hash()


def test_the_plan_holds_the_base_in_4_bits_and_its_dequantization(tmp_path: Path) -> None:
    from fsdpjob.orchestrator.core.jobspec.profiles import load_profile
    from fsdpjob.orchestrator.core.units import GiB
    from fsdpjob.orchestrator.planner.fit import make_plan
    from fsdpjob.orchestrator.planner.lora import NF4_BYTES
    from fsdpjob.orchestrator.planner.resolve import resolve

    (tmp_path / "config.json").write_text(json.dumps(LLAMA2_7B))
    profile = load_profile("h100").model_copy(update={"gpus_per_node": 2, "max_nodes": None, "env": {}})

    def plan(**model):
        spec = JobSpec.model_validate({
            "name": "q", "model": {"path": str(tmp_path), "dtype": "bfloat16", "activation_checkpointing": "full",
                                   "lora": {"r": 64, "alpha": 16.0}, **model},
            "data": {"path": "/d.jsonl", "seq_len": 2048}, "train": {"max_steps": 10},
            "resources": {"gpus_per_node": 2}})
        return make_plan(resolve(spec, profile))

    lora, qlora = plan(), plan(quantize="nf4")
    tr = qlora.trainable
    layer_linears = 4 * 4096 * 4096 + 3 * 4096 * 11008
    assert tr.layer_quantized == layer_linears and tr.quantized == 32 * layer_linears
    assert tr.largest_quantized == 4096 * 11008 and lora.trainable.quantized == 0
    params = {i.name: i.bytes for i in qlora.device.state}
    lora_params = {i.name: i.bytes for i in lora.device.state}
    # Per rank: the 4-bit linears at NF4_BYTES, the rest (embeddings, norms, head, adapters) in bf16.
    saved = tr.quantized // 2 * (2 - NF4_BYTES)
    assert lora_params["parameters"] - params["parameters"] == pytest.approx(saved, rel=1e-4)
    items = {i.name for m in qlora.device.moments for i in m.items}
    assert "4-bit dequantization" in items and "4-bit dequantization" not in {
        i.name for m in lora.device.moments for i in m.items}
    assert qlora.device.peak < lora.device.peak - 4 * GiB


def test_a_world_size_the_4_bit_weights_cannot_be_cut_into_is_refused_by_the_plan(tmp_path: Path) -> None:
    from fsdpjob.orchestrator.core.jobspec.profiles import load_profile
    from fsdpjob.orchestrator.core.savers import nf4_scaler_block, nf4_shard_problem
    from fsdpjob.orchestrator.planner.fit import make_plan
    from fsdpjob.orchestrator.planner.resolve import resolve

    assert nf4_scaler_block(4096 * 4096) == 256 and nf4_scaler_block(32 * 64) == 4  # small: 8 groups of 4 scales
    assert nf4_shard_problem(4096, 4096, 8) is None and "6 shards" in nf4_shard_problem(4096, 4096, 6)
    (tmp_path / "config.json").write_text(json.dumps(LLAMA2_7B))
    profile = load_profile("h100").model_copy(update={"max_nodes": None, "env": {}})

    def plan(gpus: int):
        spec = JobSpec.model_validate({
            "name": "q", "model": {"path": str(tmp_path), "dtype": "bfloat16", "lora": {}, "quantize": "nf4"},
            "data": {"path": "/d.jsonl", "seq_len": 2048}, "train": {"max_steps": 10},
            "resources": {"nodes": 1, "gpus_per_node": gpus}})
        return make_plan(resolve(spec, profile))

    assert plan(8).refusal is None
    refused = plan(6)
    assert refused.verdict == "REFUSED" and refused.refusal.startswith("model.quantize nf4: q_proj: a 4096 x 4096 "
                                                                       "weight cannot be cut into 6 shards"), refused
