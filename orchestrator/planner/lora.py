"""What trains, for the memory and time model: every parameter in full fine-tuning; with LoRA (spec model.lora)
the adapters and modules_to_save, while the frozen base is held as weights only (no gradients, no AdamW state).

Pure arithmetic from the model's shape (no torch): an adapter on a linear layer of in x out features adds
r x (in + out) parameters (A: r x in, B: out x r). The layer names and shapes below are those of the families'
transformers modeling code; ``all-linear`` is every linear layer in the decoder blocks (peft leaves out the
output head). Names the table does not know are counted as hidden x hidden, with a warning.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from fsdpjob.orchestrator.core.jobspec.families import FAMILIES, Family, lora_targets
from fsdpjob.orchestrator.core.savers import nf4_shard_problem

from .modelshape import ModelShape, ParamCount

_EMBEDDINGS = ("embed_tokens", "wte", "word_embeddings", "embed_in")
# model.quantize nf4 (jobs/model/quantize.py): per weight 4 bits of code, an int8 scale per block of 64 and an fp32
# factor per group of 256 scales (torchao's NF4 with the QLoRA paper's double quantization).
NF4_BYTES = 0.5 + 1 / 64 + 4 / (64 * 256)
# torchao dequantizes a 4-bit weight in plain torch ops, all alive until it returns: two int64 index tensors of
# half the weight each (8 B a weight), then the looked-up values, their scaled copies and the stacked result in
# model.dtype (3 m bytes a weight); the linear then casts to the compute dtype where that differs.
DEQUANT_INDEX_BYTES, DEQUANT_COPIES = 8, 3
_HEADS = ("lm_head", "embed_out")


@dataclass(frozen=True)
class Trainable:
    """Parameter counts by role; full fine-tuning trains everything, LoRA adds and trains a little."""

    weights: int  # every parameter held: the model's, the adapters' and modules_to_save's trained copies
    trained: int  # parameters with gradients and AdamW state (saved in checkpoints)
    layer_weights: int  # per decoder layer, gathered with it
    layer_trained: int  # per decoder layer, with gradients
    root_weights: int  # in the root unit (embedding, final norm, lm_head, and their trained copies)
    root_trained: int
    head_trained: bool  # lm_head gets a gradient (held unsharded until the root's reduce-scatter)
    lora: Any = None  # the spec's model.lora; None for full fine-tuning
    note: str | None = None  # why the adapter count is an estimate (a plan warning)
    quantized: int = 0  # model.quantize nf4: weights held in 4 bits (the frozen linears of the decoder blocks)
    layer_quantized: int = 0  # of them, per decoder layer
    largest_quantized: int = 0  # the largest 4-bit linear weight (its dequantized copy is the transient)

    @property
    def is_lora(self) -> bool:
        return self.lora is not None


def full_training(s: ModelShape, p: ParamCount) -> Trainable:
    return Trainable(weights=p.total, trained=p.total, layer_weights=p.per_layer, layer_trained=p.per_layer,
                     root_weights=p.root, root_trained=p.root, head_trained=True)


def _linear_shapes(s: ModelShape) -> dict[str, list[tuple[int, int]]]:
    """(in, out) of each linear layer in one decoder block, by module name, across the supported families."""
    h, i, q, kv = s.hidden, s.intermediate, s.q_dim, s.kv_dim
    experts = max(1, s.experts)
    mlp = {"gate_proj": [(h, i)] * experts if s.gated_mlp else [], "up_proj": [(h, i)] * experts,
           "down_proj": [(i, h)] * experts}
    if s.shared_expert:
        mlp = {k: v + [(h, s.shared_expert) if k != "down_proj" else (s.shared_expert, h)] for k, v in mlp.items()}
    return {
        "q_proj": [(h, q)], "k_proj": [(h, kv)], "v_proj": [(h, kv)], "o_proj": [(q, h)], **mlp,
        "qkv_proj": [(h, q + 2 * kv)], "gate_up_proj": [(h, 2 * i)],  # phi3
        "query_key_value": [(h, q + 2 * kv)], "dense": [(q, h)],  # gpt_neox, falcon; phi's dense
        "dense_h_to_4h": [(h, i)], "dense_4h_to_h": [(i, h)], "fc1": [(h, i)], "fc2": [(i, h)],
        # gpt2: c_proj in attention and MLP; starcoder2: in the MLP only
        "c_attn": [(h, 3 * h)], "c_proj": [(h, h), (i, h)] if _family(s).c_proj_in_attention else [(i, h)],
        "c_fc": [(h, i)],
        "gate": [(h, s.experts)] if s.experts > 1 else [],  # the MoE router
    }


def _family_linears(s: ModelShape) -> list[str]:
    """The names all-linear finds in one decoder block of this family (core/jobspec/families.py)."""
    own = _family(s).lora_linears
    if own is not None:
        return list(own)
    mlp = ["gate_proj", "up_proj", "down_proj"] if s.gated_mlp else ["up_proj", "down_proj"]
    return ["q_proj", "k_proj", "v_proj", "o_proj", *mlp, *(["gate"] if s.experts > 1 else [])]


def _family(s: ModelShape) -> Family:
    return FAMILIES.get(s.model_type) or Family()


def _adapted(s: ModelShape, lora: Any) -> tuple[list[str], list[tuple[int, int]], list[str]]:
    """The target names, the (in, out) of each adapted linear layer in one decoder block, the unknown names."""
    shapes = _linear_shapes(s)
    targets = lora_targets(s.model_type, lora.target_modules)
    names = _family_linears(s) if targets == "all-linear" else [n.rpartition(".")[2] for n in targets]
    unknown = sorted({n for n in names if n not in shapes and n not in _EMBEDDINGS and n not in _HEADS})
    per_layer = [shape for n in names for shape in shapes.get(n, [])] + [(s.hidden, s.hidden)] * len(unknown)
    return names, per_layer, unknown


# The embedding and output head of each family, by the names peft matches (Llama's unless listed); gpt_neox's
# head is lm_head in transformers 5 (embed_out before).
_ROOT_NAMES = {"gpt2": ("wte", "lm_head"), "gpt_neox": ("embed_in", "lm_head"),
               "falcon": ("word_embeddings", "lm_head")}


def target_problem(s: ModelShape, lora: Any) -> str | None:
    """Why model.lora.target_modules names modules this family does not have (peft would refuse them on the workers,
    after the queue), or None. A dotted name is judged by its last part, as peft matches it; a family the table
    does not know is not judged."""
    if lora is None or lora.target_modules in ("auto", "all-linear") or s.model_type not in FAMILIES:
        return None
    valid = [*_family_linears(s), *(["shared_expert_gate"] if s.shared_expert else []),
             *_ROOT_NAMES.get(s.model_type, ("embed_tokens", "lm_head"))]
    bad = [n for n in lora.target_modules if n.rpartition(".")[2] not in valid]
    if not bad:
        return None
    return (f"{', '.join(bad)}: no such linear layer in a {s.model_type} model; name some of {', '.join(valid)}, or "
            "write all-linear")


def adapter_activations(s: ModelShape, lora: Any, compute_bytes: int) -> int:
    """Bytes LoRA's forward keeps per token in one decoder layer, on top of the layer's own: A's output (r per
    adapted layer) and, with dropout, its own dropped copy of the input (and the mask)."""
    if lora is None:
        return 0
    _, per_layer, _ = _adapted(s, lora)
    dropped = (compute_bytes + 1) if lora.dropout else 0
    return sum(lora.r * compute_bytes + fan_in * dropped for fan_in, _ in per_layer)


def lora_training(s: ModelShape, p: ParamCount, lora: Any) -> Trainable:
    """Counts with the adapters of ``lora`` (the spec's model.lora) on a frozen base."""
    names, per_layer, unknown = _adapted(s, lora)
    layer_adapters = sum(lora.r * (fan_in + fan_out) for fan_in, fan_out in per_layer)
    root_adapters = sum(lora.r * (s.vocab + s.hidden) for n in names if n in _EMBEDDINGS + _HEADS)
    saved = {n.rpartition(".")[2] for n in lora.modules_to_save}
    head = bool(saved & set(_HEADS))
    copies = s.vocab * s.hidden * (bool(saved & set(_EMBEDDINGS)) + head)
    notes = []
    if s.experts > 1 and any(n in ("gate_proj", "up_proj", "down_proj", "gate") for n in names):
        notes.append(f"model_type {s.model_type!r} (mixture of experts): the adapter count is estimated (peft "
                     "adapts fused expert weights its own way)")
    if unknown:
        notes.append(f"model.lora.target_modules {unknown}: shapes unknown to the planner, counted as hidden x "
                     "hidden per layer")
    if set(saved) - set(_EMBEDDINGS) - set(_HEADS):
        notes.append(f"model.lora.modules_to_save {sorted(saved - set(_EMBEDDINGS) - set(_HEADS))}: not counted "
                     "by the planner")
    trained = s.layers * layer_adapters + root_adapters + copies
    return Trainable(
        weights=p.total + trained, trained=trained,
        layer_weights=p.per_layer + layer_adapters, layer_trained=layer_adapters,
        root_weights=p.root + root_adapters + copies, root_trained=root_adapters + copies,
        head_trained=head,
        lora=lora, note="; ".join(notes) or None,
    )


def quantized_shapes(s: ModelShape) -> list[tuple[str, int, int]]:
    """(name, rows, columns) of each linear weight one decoder block holds in 4 bits with model.quantize nf4: every
    linear layer all-linear finds (the frozen base layers under the adapters and the frozen linears beside them), but
    a mixture of experts' MLP: transformers keeps its experts in fused 3-D tensors (and its router in its own
    module), which stay in model.dtype; a shared expert's linears are left out of the count as well."""
    shapes = _linear_shapes(s)
    mlp = {"gate_proj", "up_proj", "down_proj", "gate", "c_fc", "fc1", "fc2", "dense_h_to_4h", "dense_4h_to_h",
           "gate_up_proj"}
    names = [n for n in _family_linears(s) if not (s.experts > 1 and n in mlp)]
    return [(n, fan_out, fan_in) for n in names for fan_in, fan_out in shapes.get(n, [])]


def quantized_linears(s: ModelShape) -> list[int]:
    return [rows * columns for _, rows, columns in quantized_shapes(s)]


def quantize_problem(s: ModelShape, shards: int) -> str | None:
    """Why the 4-bit weights cannot be sharded over ``shards`` ranks (core/savers.nf4_shard_problem), or None."""
    for name, rows, columns in quantized_shapes(s):
        if problem := nf4_shard_problem(rows, columns, shards):
            return (f"model.quantize nf4: {name}: {problem}; FSDP2 cannot pad 4-bit shards: run on a number of "
                    "ranks that divides them or drop model.quantize")
    return None


def trainable(s: ModelShape, p: ParamCount, lora: Any, quantize: str | None = None) -> Trainable:
    counts = full_training(s, p) if lora is None else lora_training(s, p, lora)
    if quantize is None or lora is None:
        return counts
    sizes = quantized_linears(s)
    return replace(counts, quantized=s.layers * sum(sizes), layer_quantized=sum(sizes),
                   largest_quantized=max(sizes, default=0))


def held_bytes(count: int, quantized: int, dtype_bytes: int) -> int:
    """Bytes of ``count`` weights of which ``quantized`` are in 4 bits, the rest in ``dtype_bytes``."""
    return (count - quantized) * dtype_bytes + math.ceil(quantized * NF4_BYTES)


def dequant_bytes(tr: Trainable, model_bytes: int, compute_bytes: int) -> int:
    """The transient of dequantizing the largest 4-bit weight (see DEQUANT_INDEX_BYTES)."""
    per_weight = DEQUANT_INDEX_BYTES + DEQUANT_COPIES * model_bytes + compute_bytes * (compute_bytes != model_bytes)
    return tr.largest_quantized * per_weight
