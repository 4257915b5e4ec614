"""The spec's model section (ModelSpec, part of spec.py's JobSpec): the model folder, its dtype and kernels, the
memory savers that change how it runs (activation checkpointing, compile) and LoRA."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, field_validator, model_validator

from .validation import Strict, field_error, path_value

PositiveInt = Annotated[int, Field(strict=True, gt=0)]

# The dtype fields came with two spellings (fsdp.mixed_precision: bf16/fp32, the others: bfloat16/float32); each
# takes both and keeps its own, so the specs (and spec hashes) of existing runs read as before.
_SPELLINGS = {"bf16": "bfloat16", "fp32": "float32"}


def _long_dtype(value: Any) -> Any:
    return _SPELLINGS.get(value, value) if isinstance(value, str) else value


def _short_dtype(value: Any) -> Any:
    short = {long: short for short, long in _SPELLINGS.items()}
    return short.get(value, value) if isinstance(value, str) else value


Dtype = Annotated[Literal["float32", "bfloat16"], BeforeValidator(_long_dtype)]  # fp32 and bf16 are read as these
ShortDtype = Annotated[Literal["bf16", "fp32"], BeforeValidator(_short_dtype)]  # bfloat16 and float32 as these

_MODULE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z0-9_]+)*")


def _module_names(value: list[str]) -> list[str]:
    bad = [n for n in value if not isinstance(n, str) or not _MODULE_NAME.fullmatch(n)]
    if bad:
        raise ValueError(f"{bad} are not module names; give names like q_proj or model.embed_tokens")
    if len(set(value)) != len(value):
        raise ValueError("names are listed twice; list each module once")
    return value


class LoraSpec(Strict):
    r: PositiveInt = 16
    """Rank of the adapter matrices (A: r x in, B: out x r)."""
    alpha: Annotated[float, Field(strict=True, gt=0)] = 32.0
    """Adapter scaling: the adapters' output is multiplied by alpha / r."""
    dropout: Annotated[float, Field(strict=True, ge=0, lt=1)] = 0.0
    """Dropout on the adapters' input (0: off)."""
    target_modules: Literal["auto", "all-linear"] | Annotated[list[str], Field(min_length=1)] = "auto"
    ("Modules that get adapters: module names (the last part, e.g. q_proj and v_proj, or a dotted path); "
     "all-linear: every linear layer but the output head; auto: all-linear, except on mixture-of-experts families "
     "(mixtral, qwen3_moe, olmoe, gpt_oss, deepseek_v3 ...) the attention's linear layers only: the router and the "
     "experts stay frozen unless you write all-linear or name them.")
    modules_to_save: list[str] = []
    ("Modules trained in full next to the adapters, e.g. embed_tokens and lm_head for added tokens; checkpointed and "
     "exported with them.")

    _names = field_validator("modules_to_save")(_module_names)

    @field_validator("target_modules")
    @classmethod
    def _targets(cls, value: str | list[str]) -> str | list[str]:
        return value if isinstance(value, str) else _module_names(value)


class ModelSpec(Strict):
    path: str
    """Local Hugging Face model folder (config.json, safetensors weights, tokenizer). Relative to the spec file."""
    dtype: Dtype = "float32"
    ("Dtype of the sharded master weights and optimizer state. float32 with fsdp.mixed_precision=bf16 is the usual "
     "choice.")
    attn_implementation: Literal["auto", "varlen", "sdpa", "eager", "flash_attention_2"] = "auto"
    ("Attention kernel. auto: varlen on GPUs for boundary-aware packing in bf16 (each example attends to itself with "
     "torch's flash varlen kernel, no mask, no package to install), else sdpa. varlen: that kernel wherever asked (on "
     "CPU: SDPA per example). sdpa on a packed batch builds a dense S x S mask (counted by the plan) and runs eager on "
     "the families transformers has no sdpa path for (gemma2). flash_attention_2 needs the flash-attn package on CUDA.")
    activation_checkpointing: Literal["none", "full", "selective"] | bool = "none"  # a bool: read as full or none
    ("Recompute activations in backward instead of keeping them. full: each decoder layer's (far less activation "
     "memory for ~30% more compute); selective: part of them, as model.selective_ac says; none: keep all. true and "
     "false stay as full and none.")
    selective_ac: Literal["op"] | Annotated[int, Field(strict=True, gt=0)] = "op"
    ("With activation_checkpointing: selective. op: keep the matmuls' outputs and recompute the rest (torchtitan's op "
     "option); a number N: checkpoint every N-th decoder layer in full, keep the others.")
    compile: bool = False
    """torch.compile each decoder block (in place, before FSDP2 wraps it). The first steps pay the compilation;
    on GPUs it fuses the blocks' elementwise work. Measure it on your model before relying on it."""
    lora: LoraSpec | None = None
    """Train LoRA adapters (peft) on the frozen base model instead of every weight; none: full fine-tuning."""
    quantize: Literal["nf4"] | None = None
    ("QLoRA: hold the frozen base's linear weights of the decoder blocks in 4 bits (torchao's NF4 with "
     "double-quantized block scales, sharded by FSDP2 and dequantized one layer at a time), the adapters in "
     "model.dtype. Needs model.lora and the torchao package on the workers (pip install 'fsdpjob[quantize]'); "
     "none: the base in model.dtype.")

    _path = field_validator("path")(path_value)

    @field_validator("activation_checkpointing", mode="before")
    @classmethod
    def _ac_aliases(cls, value: Any) -> Any:
        return {True: "full", False: "none"}.get(value, value) if isinstance(value, bool) else value

    @model_validator(mode="after")
    def _quantize_with_lora(self) -> ModelSpec:
        if self.quantize is not None and self.lora is None:
            raise field_error("quantize", f"quantize {self.quantize} holds a frozen base in 4 bits for LoRA "
                                          "adapters (QLoRA); add model.lora or drop model.quantize")
        if self.quantize is not None and self.compile:
            raise field_error("compile", "compile with quantize nf4 is not supported in this version (untested: "
                                         "the 4-bit weights are a tensor subclass); set compile: false")
        return self

    @model_validator(mode="after")
    def _selective_alone(self) -> ModelSpec:
        if self.selective_ac != "op" and self.activation_checkpointing != "selective":
            raise field_error("selective_ac", "selective_ac applies to activation_checkpointing: selective; set it "
                                              "or drop selective_ac")
        return self
