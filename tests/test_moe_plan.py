"""The plan for mixture-of-experts models (orchestrator/planner/moe.py): FLOPs from the parameters a token runs
through (attention, router, shared and top_k routed experts), activations with the top-k routing term."""

from __future__ import annotations

from dataclasses import replace

import pytest
from specs import plan_spec, write_config

from fsdpjob.orchestrator.core.jobspec.profiles import load_profile
from fsdpjob.orchestrator.core.units import GiB
from fsdpjob.orchestrator.planner.fit import make_plan
from fsdpjob.orchestrator.planner.modelshape import count_params, read_model_shape
from fsdpjob.orchestrator.planner.moe import active_params, inactive_params, moe_mlp_activations
from fsdpjob.orchestrator.planner.resolve import resolve

# mistralai/Mixtral-8x7B-v0.1's config.json (the values the planner reads)
MIXTRAL_8X7B = {
    "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "vocab_size": 32000, "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "num_local_experts": 8, "num_experts_per_tok": 2, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
}  # fmt: skip
SEQ = 4096


def _plan(tmp_path, cfg: dict, **model):
    folder = write_config(tmp_path / f"m{cfg['num_experts_per_tok']}", cfg)
    spec = plan_spec(folder, model={"dtype": "bfloat16", **model}, data={"seq_len": SEQ},
                     train={"micro_batch_size": 1}, resources={"nodes": 2, "gpus_per_node": 8})
    return make_plan(resolve(spec, load_profile("h100")))


def test_mixtral_8x7b_counts_every_expert_but_runs_two(tmp_path):
    s = read_model_shape(write_config(tmp_path, MIXTRAL_8X7B))
    p = count_params(s)
    assert (s.experts, s.top_k) == (8, 2)
    assert p.total / 1e9 == pytest.approx(46.70, abs=0.01)
    assert active_params(s, p) / 1e9 == pytest.approx(12.88, abs=0.01)  # Mistral's "12.9B active"
    assert inactive_params(replace(s, experts=1, top_k=1)) == 0


def test_mixtral_step_flops_are_six_per_active_matmul_weight(tmp_path):
    plan = _plan(tmp_path, MIXTRAL_8X7B)
    s = read_model_shape(tmp_path / "m2")
    p = count_params(s)
    matmul = active_params(s, p) - p.embedding
    attention = 6 * s.layers * SEQ * s.q_dim  # 3 x (fwd: 2 x layers x seq x q_dim)
    per_token = plan.timing.flops_per_rank / SEQ  # one row of seq_len tokens per rank and step
    assert per_token == pytest.approx(6 * matmul + attention, rel=1e-6)
    assert per_token < 0.3 * 6 * p.total  # not every expert: ~3.6x fewer FLOPs than all 46.7B


def test_activations_count_each_routed_copy_the_router_and_permute_buffers(tmp_path):
    two = _plan(tmp_path, MIXTRAL_8X7B).device
    one = _plan(tmp_path, {**MIXTRAL_8X7B, "num_experts_per_tok": 1}).device
    kept = {i.name: i.bytes for i in two.live}["activations"] - {i.name: i.bytes for i in one.live}["activations"]
    c, h, i = 2, 4096, 14336
    # per token and layer, one more routed copy: the expert MLP (4c i), its permuted input and output (2c h), and
    # its routing weight and index (4 + 8)
    assert kept == 32 * SEQ * (4 * c * i + 2 * c * h + 12)
    s = read_model_shape(tmp_path / "m2")
    assert moe_mlp_activations(s, c, False) == 4 * c * 2 * i + 8 * (c + 4) + 2 * 12 + 2 * 2 * c * h
    assert {i.name: i.bytes for i in two.live}["activations"] / GiB == pytest.approx(43.67, abs=0.01)


def test_shared_experts_are_active_and_deepseek_names_are_read(tmp_path):
    cfg = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 1000,
           "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 4, "n_routed_experts": 8, "n_shared_experts": 2,
           "num_experts_per_tok": 2}  # fmt: skip
    s = read_model_shape(write_config(tmp_path, cfg))
    assert (s.experts, s.top_k, s.shared_expert, s.intermediate) == (8, 2, 64, 32)
    assert s.estimate is not None and inactive_params(s) == 0  # no count from config.json: nothing to subtract
