"""Tiny random configs of the model families fsdpjob trains (tests only): hidden 32, 2 layers, vocab 256."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fsdpjob.orchestrator.core.jobspec.families import FAMILIES as TABLE

VOCAB = 256
_BASE = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
)  # fmt: skip
_OWN = {
    "gemma": dict(head_dim=8),
    "gemma2": dict(head_dim=8),
    "gemma3_text": dict(head_dim=8),
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, output_router_logits=True),
    "granitemoe": dict(num_local_experts=4, num_experts_per_tok=2),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, output_router_logits=True),
    "olmoe": dict(num_experts=4, num_experts_per_tok=2, output_router_logits=True),
    "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2, head_dim=8, sliding_window=16,
                    output_router_logits=True),
    # first layer dense, the second shared + routed; multi-head latent attention; plain RoPE (the default is YaRN)
    "deepseek_v3": dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
                        first_k_dense_replace=1, n_group=1, topk_group=1, kv_lora_rank=16, q_lora_rank=None,
                        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, head_dim=8, num_key_value_heads=4,
                        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=48),
    "gpt2": dict(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_inner=64, n_positions=64, bos_token_id=1,
                 eos_token_id=2),
    "falcon": dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, pad_token_id=0,
                   bos_token_id=1, eos_token_id=2),
}  # fmt: skip
# The families the worker tests train, at least one of each layer layout: model.layers (most), transformer.h
# (gpt2, falcon), gpt_neox.layers.
FAMILIES = (
    "llama", "qwen2", "qwen3", "mistral", "gemma", "gemma2", "phi", "phi3", "olmo", "olmo2", "stablelm",
    "granite", "mixtral", "gpt2", "gpt_neox", "falcon",
)  # fmt: skip
# The mixture-of-experts families (tests/worker/test_moe_families.py: trains, resumes, exports each).
MOE_FAMILIES = ("mixtral", "qwen3_moe", "olmoe", "gpt_oss", "deepseek_v3")
assert set(FAMILIES) <= set(TABLE) and set(MOE_FAMILIES) <= set(TABLE)
# ministral's config class leaves head_dim None, so no tiny model of it can be built from a config alone.
_NO_TINY_CONFIG = ("ministral",)

# Every family the planner counts exactly from config.json alone (tests/test_modelshape_families.py).
PLANNED_FAMILIES = FAMILIES + tuple(
    name for name, family in TABLE.items()
    if family.exact_from_config and name not in FAMILIES and name not in _NO_TINY_CONFIG
)


def tiny_config(family: str, **overrides: Any):
    from transformers import AutoConfig

    own = _OWN.get(family, {})
    base = own if family in ("gpt2", "falcon") else {**_BASE, **own}
    return AutoConfig.for_model(family, **{**base, **overrides})


def save_tiny_family(path: Path, family: str, *, seed: int = 0, **overrides: Any):
    """A tiny random model of ``family`` saved with save_pretrained (safetensors); returns the model."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(family, **overrides))
    model.save_pretrained(path)
    return model
