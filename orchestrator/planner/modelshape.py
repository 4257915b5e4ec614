"""A decoder-only model's shape from its config.json, and its parameter count: pure file reads, no torch
or transformers (the planner runs on the login node)."""

from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import dataclass, replace
from pathlib import Path

from fsdpjob.orchestrator.core.errors import InputError
from fsdpjob.orchestrator.core.jobspec.families import FAMILIES, Family, windowed
from fsdpjob.orchestrator.core.weightfiles import INDEX_FILE, SINGLE_FILE, read_header, weight_files

# Families whose parameter count from config.json alone is checked against transformers (tests); for the
# others the plan says the count is an estimate unless the safetensors headers give the exact one.
EXACT_FROM_CONFIG = frozenset(name for name, family in FAMILIES.items() if family.exact_from_config)
# The names each config key goes by across families, first match wins.
_ALIASES = {
    "vocab_size": ("vocab_size", "padded_vocab_size"),
    "hidden_size": ("hidden_size", "n_embd", "d_model", "dim"),
    "num_hidden_layers": ("num_hidden_layers", "n_layer", "num_layers", "n_layers"),
    "num_attention_heads": ("num_attention_heads", "n_head", "num_heads", "n_heads"),
    "intermediate_size": ("intermediate_size", "n_inner", "ffn_hidden_size", "ffn_dim"),
}
_HEADER_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64", "F8_E4M3": "float8"}


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
    gated_mlp: bool = True
    norm_params: int = 1  # parameters per hidden unit of one norm: 1 (RMSNorm), 2 (LayerNorm + bias), 0
    norms: int = 2  # norms per layer
    final_norm: bool = True
    qk_norm_full: bool = False  # OLMo2: q/k norms over all heads, not per head
    positions: int = 0  # learned position embeddings (GPT-2)
    lm_head_bias: bool = False
    experts: int = 1  # MoE: every expert counts
    top_k: int = 1  # MoE: experts each token is routed to (num_experts_per_tok)
    shared_expert: int = 0  # intermediate size of the always-on experts (Qwen2-MoE, DeepSeek-V3)
    windowed: bool = False  # attention beyond causal-per-example (sliding window, soft-capping): no varlen kernel
    counted: ParamCount | None = None  # exact, from the safetensors headers
    # safetensors weights in the folder (by name only): each worker reads just its own shards of them
    safetensors: bool = False
    estimate: str | None = None  # why the parameter count is only an estimate (a plan warning)

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim


def _config_error(path: Path, message: str) -> InputError:
    return InputError(message, file=str(path), loc="model.path")


def _first(cfg: dict, key: str) -> object:
    return next((cfg[k] for k in _ALIASES.get(key, (key,)) if isinstance(cfg.get(k), int)), None)


def _kv_heads(cfg: dict, f: Family, heads: int) -> int:
    if f.mha_only:
        return heads
    if f.falcon_layout and not cfg.get("new_decoder_architecture"):
        return 1 if cfg.get("multi_query", True) else heads
    for key in ("num_key_value_heads", "num_kv_heads", "n_head_kv"):
        if isinstance(cfg.get(key), int) and cfg[key]:
            return cfg[key]
    return (cfg["num_key_value_heads"] if "num_key_value_heads" in cfg else f.omitted_kv_heads) or heads


def _norms(cfg: dict, f: Family) -> int:
    if not f.falcon_layout:
        return f.norms
    if cfg.get("new_decoder_architecture", False):
        return cfg.get("num_ln_in_parallel_attn") or 2
    return 1 if cfg.get("parallel_attn", True) else 2


def _biases(cfg: dict, f: Family) -> tuple[bool, bool, bool]:
    """(qkv, o, mlp) biases: the family's fixed ones, or switched on by config.json."""
    own = bool(cfg.get(f.bias_key[0], f.bias_key[1])) if f.bias_key else False
    attention = bool(cfg.get("attention_bias", False)) or own
    qkv = f.qkv_bias or bool(cfg.get("use_qkv_bias")) or attention
    o = f.o_bias or (attention and not f.attention_bias_skips_o) or bool(cfg.get("attention_out_bias"))
    follows = {"attention": attention, "bias_key": own}.get(f.mlp_bias_follows or "", False)
    mlp = f.mlp_bias or (f.mlp_bias_key and bool(cfg.get("mlp_bias", False))) or follows
    return qkv, o, mlp


def read_safetensors_header(file: Path) -> dict[str, dict]:
    """The tensor table of one safetensors file."""
    return read_header(file)[0]


def _weight_headers(folder: Path) -> dict[str, dict] | None:
    try:
        files = weight_files(folder)
        if files is None:
            return None
        tensors: dict[str, dict] = {}
        for file in files:
            tensors.update(read_safetensors_header(file))
        return tensors
    except (OSError, ValueError, KeyError, TypeError, struct.error):
        return None  # a partial download: plan from config.json


_LAYER_INDEX = re.compile(r"\.(\d+)\.")


def _is_buffer(name: str, shape: list[int]) -> bool:
    """Buffers some older checkpoints store (GPT-2's causal mask ``attn.bias``, rotary ``inv_freq``): no parameters."""
    return name.endswith(("inv_freq", "masked_bias")) or (name.endswith(".bias") and len(shape) > 1)


def _is_head(name: str) -> bool:
    return any(part in ("lm_head", "embed_out") for part in name.split(".")[:-1])


def _count_from_headers(tensors: dict[str, dict], layers: int, tied: bool) -> ParamCount | None:
    """Exact counts by tensor name: numbered blocks are layers, the rest is the root. None if layers differ."""
    sizes = {name: math.prod(t["shape"]) for name, t in tensors.items() if not _is_buffer(name, t["shape"])}
    heads = [n for n in sizes if _is_head(n)]
    embeds = [n for n in sizes if not _LAYER_INDEX.search(n) and n not in heads and sizes[n] > 0
              and any(k in n for k in ("embed", "wte", "wpe", "word_embeddings"))]  # fmt: skip
    if tied:  # a checkpoint that stores the tied head anyway still holds one parameter
        heads = [n for n in heads if not n.endswith("weight")] if embeds else heads
    per_layer: dict[int, dict[str, int]] = {}
    for name, size in sizes.items():
        found = _LAYER_INDEX.search(name)
        if not found:
            continue
        part = "attention" if any(k in name for k in ("attn", "attention", "query_key_value")) else (
            "mlp" if any(k in name for k in ("mlp", "feed_forward", "experts", "ffn", "dense_h_to_4h",
                                               "dense_4h_to_h")) else "norms")  # fmt: skip
        parts = per_layer.setdefault(int(found.group(1)), {"attention": 0, "mlp": 0, "norms": 0})
        parts[part] += size
    if len(per_layer) != layers or len({tuple(v.values()) for v in per_layer.values()}) != 1:
        return None
    embedding = sum(sizes[n] for n in embeds)
    lm_head = sum(sizes[n] for n in heads)
    rest = sum(size for name, size in sizes.items() if not _LAYER_INDEX.search(name)) - embedding
    rest -= sum(sizes[n] for n in sizes if _is_head(n))
    return ParamCount(embedding=embedding, layers=layers, final_norm=rest, lm_head=lm_head, **per_layer[0])


def _read_config(path: Path) -> dict:
    try:
        cfg = json.loads(path.read_text())
    except FileNotFoundError:
        missing = "not found; model.path must be a Hugging Face model folder with config.json"
        raise _config_error(path, missing) from None
    except json.JSONDecodeError as exc:
        raise _config_error(path, f"line {exc.lineno}: not valid JSON ({exc.msg})") from None
    if isinstance(cfg.get("text_config"), dict):  # multimodal wrappers: the language model's own config
        cfg = {**cfg["text_config"], "model_type": cfg["text_config"].get("model_type", cfg.get("model_type"))}
    return cfg


def _need(cfg: dict, key: str, path: Path) -> int:
    value = _first(cfg, key)
    if not isinstance(value, int):
        names = " / ".join(_ALIASES.get(key, (key,)))
        raise _config_error(path, f"{names} is missing or not an integer; the planner needs it to size the model")
    return value


def _shared_expert(cfg: dict) -> int:
    """The always-on experts' intermediate size: Qwen2-MoE's one, DeepSeek's n_shared_experts routed-sized ones."""
    if cfg.get("shared_expert_intermediate_size"):
        return cfg["shared_expert_intermediate_size"]
    return (cfg.get("n_shared_experts") or 0) * (cfg.get("moe_intermediate_size") or 0)


def read_model_shape(model_dir: str | Path) -> ModelShape:
    """Parse ``<model_dir>/config.json`` (and the safetensors headers, where the weights are there)."""
    folder = Path(model_dir)
    path = folder / "config.json"
    cfg = _read_config(path)
    model_type = str(cfg.get("model_type"))
    family = FAMILIES.get(model_type)
    f = family or Family()
    heads, hidden = _need(cfg, "num_attention_heads", path), _need(cfg, "hidden_size", path)
    layers, vocab = _need(cfg, "num_hidden_layers", path), _need(cfg, "vocab_size", path)
    experts = cfg.get("num_local_experts") or cfg.get("num_experts") or cfg.get("n_routed_experts") or 1
    intermediate = _first(cfg, "intermediate_size") or 4 * hidden
    if experts > 1 and isinstance(cfg.get("moe_intermediate_size"), int):
        intermediate = cfg["moe_intermediate_size"]
    qk_norm = f.qk_norm or ("head" if cfg.get("qk_layernorm") else None)
    tied = bool(cfg.get("tie_word_embeddings", f.tied))
    qkv_bias, o_bias, mlp_bias = _biases(cfg, f)
    shape = ModelShape(
        model_type=model_type, vocab=vocab, hidden=hidden, intermediate=intermediate, layers=layers, heads=heads,
        kv_heads=_kv_heads(cfg, f, heads),
        head_dim=(cfg["head_dim"] if "head_dim" in cfg else f.omitted_head_dim) or hidden // heads,
        tied=tied, qkv_bias=qkv_bias, o_bias=o_bias, mlp_bias=mlp_bias,
        qk_norm=qk_norm is not None, qk_norm_full=qk_norm == "full",
        checkpoint_dtype=str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32"),
        gated_mlp=f.gated, norm_params=2 if f.ln_bias else 1, norms=_norms(cfg, f), final_norm=f.final_norm,
        positions=(cfg.get("n_positions") or 1024) * hidden if f.positions else 0,
        lm_head_bias=f.lm_head_bias, experts=experts,
        top_k=min(cfg.get("num_experts_per_tok") or 1, experts) if experts > 1 else 1,
        shared_expert=_shared_expert(cfg) if f.shared_expert else 0,
        safetensors=(folder / SINGLE_FILE).is_file() or (folder / INDEX_FILE).is_file(),
        windowed=windowed(cfg),
    )  # fmt: skip
    tensors = _weight_headers(folder)
    counted = _count_from_headers(tensors, layers, tied) if tensors else None
    if counted is not None:
        dtypes = {t.get("dtype") for t in tensors.values()}  # type: ignore[union-attr]
        dtype = _HEADER_DTYPES.get(dtypes.pop(), shape.checkpoint_dtype) if len(dtypes) == 1 else None
        return replace(shape, counted=counted, checkpoint_dtype=dtype or shape.checkpoint_dtype)
    if family is None or model_type not in EXACT_FROM_CONFIG:
        rough = 12 * layers * hidden * hidden + vocab * hidden * (1 if tied else 2)
        known = "its count from config.json is not checked" if family else "the planner does not know its layers"
        why = (f"model_type {model_type!r}: {known} and {folder} has no safetensors weights to count; parameters "
               f"estimated as 12 x layers x hidden^2 + vocab x hidden (~{rough / 1e9:.3g}B): the memory plan is "
               "rough")  # fmt: skip
        return replace(shape, estimate=why)
    return shape


def _config_count(s: ModelShape) -> ParamCount:
    h, i = s.hidden, s.intermediate
    attention = h * s.q_dim + 2 * h * s.kv_dim + s.q_dim * h
    attention += (s.q_dim + 2 * s.kv_dim) * s.qkv_bias + h * s.o_bias
    if s.qk_norm:
        width = (s.q_dim + s.kv_dim) if s.qk_norm_full else 2 * s.head_dim
        attention += width * s.norm_params
    expert = (3 if s.gated_mlp else 2) * h * i + ((2 * i if s.gated_mlp else i) + h) * s.mlp_bias
    mlp = expert * s.experts + (h * s.experts if s.experts > 1 else 0)
    if s.shared_expert:
        mlp += 3 * h * s.shared_expert + h
    return ParamCount(
        embedding=s.vocab * h + s.positions,
        attention=attention,
        mlp=mlp,
        norms=s.norms * h * s.norm_params,
        layers=s.layers,
        final_norm=h * s.norm_params * s.final_norm,
        lm_head=(0 if s.tied else s.vocab * h) + s.vocab * s.lm_head_bias,
    )


def count_params(s: ModelShape) -> ParamCount:
    """Exact counts from the safetensors headers where the weights are there, else from config.json."""
    if s.counted is not None:
        return s.counted
    if s.estimate is not None:  # 12 h^2 per layer (4 attention + 8 MLP), one embedding, one head unless tied
        h = s.hidden
        return ParamCount(embedding=s.vocab * h, attention=4 * h * h, mlp=8 * h * h, norms=0, layers=s.layers,
                          final_norm=0, lm_head=0 if s.tied else s.vocab * h)  # fmt: skip
    return _config_count(s)
