"""A decoder-only model's shape from its config.json, and its parameter count: pure file reads, no torch
or transformers (the planner runs on the login node)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from fsdpjob.orchestrator.core.errors import InputError

# Model types whose decoder layer is Llama-shaped: q/k/v/o attention with GQA, SwiGLU gate/up/down MLP,
# two RMSNorms per layer, final RMSNorm, optional tied lm_head.
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "granite")
# Defaults of the transformers config classes for keys a config.json may leave out (absent, not null):
# an untied lm_head everywhere; kv heads = heads and head_dim = hidden / heads unless listed here.
_OMITTED_DEFAULTS = {
    "num_key_value_heads": {"mistral": 8, "qwen2": 32, "qwen3": 32},
    "head_dim": {"qwen3": 128},
}


@dataclass(frozen=True)
class ModelShape:
    model_type: str
    vocab: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    tied: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    checkpoint_dtype: str

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim


@dataclass(frozen=True)
class ParamCount:
    embedding: int
    attention: int  # per layer
    mlp: int  # per layer
    norms: int  # per layer
    layers: int
    final_norm: int
    lm_head: int  # 0 when tied to the embedding

    @property
    def per_layer(self) -> int:
        return self.attention + self.mlp + self.norms

    @property
    def root(self) -> int:
        """Parameters the root FSDP unit owns: embedding, final norm, untied lm_head."""
        return self.embedding + self.final_norm + self.lm_head

    @property
    def total(self) -> int:
        return self.root + self.layers * self.per_layer


def _config_error(path: Path, message: str) -> InputError:
    return InputError(message, file=str(path), loc="model.path")


def _omitted(cfg: dict, key: str, model_type: str, fallback: int) -> int:
    value = cfg[key] if key in cfg else _OMITTED_DEFAULTS[key].get(model_type)
    return value or fallback


def read_model_shape(model_dir: str | Path) -> ModelShape:
    """Parse ``<model_dir>/config.json``; refuse model types whose layer shape the planner does not know."""
    path = Path(model_dir) / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except FileNotFoundError:
        missing = "not found; model.path must be a Hugging Face model folder with config.json"
        raise _config_error(path, missing) from None
    except json.JSONDecodeError as exc:
        raise _config_error(path, f"line {exc.lineno}: not valid JSON ({exc.msg})") from None
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise _config_error(
            path,
            f"model_type {model_type!r} is not supported by the planner; supported: {', '.join(SUPPORTED_MODEL_TYPES)}",
        )

    def need(key: str) -> int:
        if not isinstance(cfg.get(key), int):
            raise _config_error(path, f"{key} is missing or not an integer")
        return cfg[key]

    heads = need("num_attention_heads")
    hidden = need("hidden_size")
    attention_bias = bool(cfg.get("attention_bias", False))
    return ModelShape(
        model_type=model_type,
        vocab=need("vocab_size"),
        hidden=hidden,
        intermediate=need("intermediate_size"),
        layers=need("num_hidden_layers"),
        heads=heads,
        kv_heads=_omitted(cfg, "num_key_value_heads", model_type, heads),
        head_dim=_omitted(cfg, "head_dim", model_type, hidden // heads),
        tied=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=model_type == "qwen2" or attention_bias,  # qwen2 always has q/k/v biases, never o
        o_bias=attention_bias and model_type != "qwen2",
        mlp_bias=bool(cfg.get("mlp_bias", False)) and model_type in ("llama", "granite"),
        qk_norm=model_type == "qwen3",
        checkpoint_dtype=str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32"),
    )


def count_params(s: ModelShape) -> ParamCount:
    h = s.hidden
    attention = h * s.q_dim + 2 * h * s.kv_dim + s.q_dim * h
    attention += (s.q_dim + 2 * s.kv_dim) * s.qkv_bias + h * s.o_bias + 2 * s.head_dim * s.qk_norm
    mlp = 3 * h * s.intermediate + (2 * s.intermediate + h) * s.mlp_bias
    return ParamCount(
        embedding=s.vocab * h,
        attention=attention,
        mlp=mlp,
        norms=2 * h,
        layers=s.layers,
        final_norm=h,
        lm_head=0 if s.tied else s.vocab * h,
    )
