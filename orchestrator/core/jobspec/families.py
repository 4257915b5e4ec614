"""The decoder-only causal LM families fsdpjob trains, one row each: how its decoder layer differs from
Llama's for the planner's parameter count, the config.json keys it reads its own way, and the linear layers
LoRA's all-linear finds in it. Pure data, no torch: the login node's checks (core/inputs/checks.py), the planner
(planner/modelshape.py, planner/lora.py) and the tests (tests/families.py) all read it.

Every family was checked on transformers 5.24 by building it from a tiny config; FSDP wraps the blocks the
model's own ``_no_split_modules`` names (``model.layers`` in most, ``transformer.h`` in gpt2 and falcon,
``gpt_neox.layers`` in gpt_neox).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    """How a family's decoder differs from Llama's: q/k/v/o attention with GQA, a gated SwiGLU MLP, two
    RMSNorms per layer and a final RMSNorm, no biases, untied embeddings, rotary positions."""

    # -- the layer, as the transformers modeling code builds it
    gated: bool = True  # gate/up/down MLP, else up/down
    ln_bias: bool = False  # LayerNorm with a bias (2 parameters per hidden unit)
    norms: int = 2  # norms per layer; 0 for OLMo's parameter-free norms
    final_norm: bool = True
    qkv_bias: bool = False  # always on
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: str | None = None  # "head": per head dim, "full": over all heads
    tied: bool = False  # tie_word_embeddings when config.json leaves it out
    positions: bool = False  # a learned position embedding (n_positions x hidden)
    lm_head_bias: bool = False
    shared_expert: bool = False  # always-on experts: shared_expert_intermediate_size (Qwen2-MoE), or
    # n_shared_experts x moe_intermediate_size (DeepSeek-V3)
    # -- mixture of experts (routed experts and a router in its MLP)
    moe: bool = False
    # -- config.json keys read the family's own way
    bias_key: tuple[str, bool] | None = None  # (key, default) that switches the attention biases on
    attention_bias_skips_o: bool = False  # attention_bias gives q/k/v a bias, not o_proj
    mlp_bias_key: bool = False  # config's mlp_bias puts a bias on the MLP
    mlp_bias_follows: str | None = None  # "attention": the MLP has a bias when attention does; "bias_key": with it
    mha_only: bool = False  # no GQA: kv heads = heads whatever the config says
    falcon_layout: bool = False  # new_decoder_architecture, multi_query, parallel_attn decide kv heads and norms
    omitted_kv_heads: int | None = None  # the config class's num_key_value_heads when config.json leaves it out
    omitted_head_dim: int | None = None  # likewise head_dim (else hidden / heads)
    # -- the planner's count from config.json alone is checked against transformers (tests)
    exact_from_config: bool = True
    # -- LoRA: the linear layers all-linear finds in one decoder block (None: Llama's, gate_proj only when
    # gated, the MoE router when there are experts); c_proj_in_attention: gpt2's c_proj is in both halves
    lora_linears: tuple[str, ...] | None = None
    c_proj_in_attention: bool = False
    # -- LoRA's default targets (model.lora.target_modules: auto): all-linear on dense families; on mixtures of
    # experts the attention's linear layers only (the router and the experts stay frozen unless named: adapting
    # the router moves the routing, and the experts are most of the weights)
    lora_attention: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
    # -- attention: False where transformers has no SDPA path for the family (gemma2's logit soft-capping):
    # the spec's default sdpa then runs eager (see attention_for)
    sdpa: bool = True

    def lora_targets(self) -> str | tuple[str, ...]:
        """What model.lora.target_modules: auto adapts in this family (see lora_attention)."""
        return self.lora_attention if self.moe else "all-linear"


_FUSED_QKV = ("query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h")

# In the order the login node's error message lists them.
FAMILIES: dict[str, Family] = {
    "llama": Family(mlp_bias_key=True),
    "mistral": Family(omitted_kv_heads=8),
    "ministral": Family(),
    "mixtral": Family(moe=True),
    "qwen2": Family(qkv_bias=True, attention_bias_skips_o=True, omitted_kv_heads=32),
    "qwen2_moe": Family(qkv_bias=True, attention_bias_skips_o=True, shared_expert=True, moe=True),
    "qwen3": Family(qk_norm="head", omitted_kv_heads=32, omitted_head_dim=128),
    "qwen3_moe": Family(qk_norm="head", moe=True),
    "olmoe": Family(qk_norm="full", moe=True),
    # gpt-oss: attention sinks (eager only in transformers), biases on q/k/v/o, router and experts, alternating
    # sliding-window layers; DeepSeek-V3: multi-head latent attention, shared + routed experts, dense first layers.
    # Neither is counted from config.json alone (the safetensors headers give the exact count).
    "gpt_oss": Family(qkv_bias=True, o_bias=True, mlp_bias=True, sdpa=False, exact_from_config=False, moe=True,
                      lora_linears=("q_proj", "k_proj", "v_proj", "o_proj")),
    "deepseek_v3": Family(shared_expert=True, exact_from_config=False, moe=True,
                          lora_linears=("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj",
                                        "o_proj", "gate_proj", "up_proj", "down_proj"),
                          lora_attention=("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj",
                                          "o_proj")),
    "gemma": Family(tied=True, omitted_head_dim=256),
    "gemma2": Family(tied=True, norms=4, omitted_head_dim=256, sdpa=False),
    "gemma3_text": Family(tied=True, norms=4, qk_norm="head", omitted_head_dim=256),
    "phi": Family(gated=False, ln_bias=True, norms=1, qkv_bias=True, o_bias=True, mlp_bias=True, lm_head_bias=True,
                  lora_linears=("q_proj", "k_proj", "v_proj", "dense", "fc1", "fc2")),
    "phi3": Family(lora_linears=("qkv_proj", "o_proj", "gate_up_proj", "down_proj")),
    "olmo": Family(norms=0, final_norm=False),
    "olmo2": Family(qk_norm="full"),
    "olmo3": Family(qk_norm="full"),
    "granite": Family(mlp_bias_key=True),
    "granitemoe": Family(moe=True),
    "cohere": Family(tied=True, norms=1),
    "cohere2": Family(tied=True, norms=1),
    "starcoder2": Family(gated=False, ln_bias=True, tied=True, bias_key=("use_bias", True),
                         mlp_bias_follows="attention",
                         lora_linears=("q_proj", "k_proj", "v_proj", "o_proj", "c_fc", "c_proj")),
    "stablelm": Family(ln_bias=True),
    "helium": Family(exact_from_config=False),
    "smollm3": Family(),
    "glm": Family(qkv_bias=True, attention_bias_skips_o=True,
                  lora_linears=("q_proj", "k_proj", "v_proj", "o_proj", "gate_up_proj", "down_proj")),
    "glm4": Family(qkv_bias=True, norms=4, attention_bias_skips_o=True,
                   lora_linears=("q_proj", "k_proj", "v_proj", "o_proj", "gate_up_proj", "down_proj")),
    "exaone4": Family(qk_norm="head"),
    "seed_oss": Family(qkv_bias=True, attention_bias_skips_o=True),
    "arcee": Family(gated=False),
    "apertus": Family(gated=False, qk_norm="head", exact_from_config=False),
    "gpt2": Family(gated=False, ln_bias=True, qkv_bias=True, o_bias=True, mlp_bias=True, tied=True, positions=True,
                   lora_linears=("c_attn", "c_proj", "c_fc"), c_proj_in_attention=True),
    "gpt_neox": Family(gated=False, ln_bias=True, bias_key=("attention_bias", True), mlp_bias_follows="attention",
                       mha_only=True, lora_linears=_FUSED_QKV),
    "falcon": Family(gated=False, ln_bias=True, tied=True, bias_key=("bias", False), mlp_bias_follows="bias_key",
                     falcon_layout=True, lora_linears=_FUSED_QKV),
}  # fmt: skip

SUPPORTED_MODEL_TYPES = tuple(FAMILIES)
def lora_targets(model_type: str, target_modules: str | list[str]) -> str | list[str]:
    """model.lora.target_modules as peft takes it: auto resolved by the family (all-linear for a family the table
    does not know), anything else as written."""
    if target_modules != "auto":
        return target_modules
    family = FAMILIES.get(model_type) or Family()
    targets = family.lora_targets()
    return targets if isinstance(targets, str) else list(targets)


def windowed(config: Mapping) -> bool:
    """Whether a config.json's attention is more than causal within each example: a sliding window in use, logit
    soft-capping or ALiBi. Varlen attention (jobs/model/varlen.py) implements none of them."""
    sliding = config.get("sliding_window") and config.get("use_sliding_window", True)
    layer_types = config.get("layer_types") or ()
    return bool(sliding or "sliding_attention" in layer_types or config.get("attn_logit_softcapping")
                or config.get("alibi"))


# Logit transforms some families apply between lm_head and the loss inside their own forward (gemma2/3's soft cap,
# cohere's scale, granite's divisor); None or 1 is no transform. The chunked loss (train.loss) calls lm_head itself
# and would skip them.
LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def logit_transform(config: Mapping) -> str | None:
    """The config.json key of the transform the model applies to its logits after lm_head, or None."""
    return next((key for key in LOGIT_TRANSFORMS if config.get(key) not in (None, 1)), None)


def attention_for(model_type: str, requested: str, *, on_gpu: bool = False, packed: bool = False,
                  half: bool = False, windowed: bool = False) -> str:
    """The attention implementation a family trains with; the worker builds the model with it and the planner
    counts its memory.

    ``auto`` (the default) takes varlen attention where it runs and matters: on GPUs, with boundary-aware
    packing (``packed``), in bf16 compute (``half``: the flash kernel has no fp32), for plain causal attention
    (not ``windowed``); everywhere else sdpa, which on a packed GPU batch would build a dense S x S mask and
    miss the flash kernel. sdpa on a family transformers cannot run it for runs eager (transformers would
    refuse sdpa at the first forward)."""
    family = FAMILIES.get(model_type)
    if requested == "auto":
        varlen = on_gpu and packed and half and not windowed and (family is None or family.sdpa)
        requested = "varlen" if varlen else "sdpa"
    return "eager" if requested == "sdpa" and family is not None and not family.sdpa else requested
