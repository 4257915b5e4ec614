"""The moments of one training step and what is alive at each, per rank (memory.py's docstring has the model).

With fsdp.separate_root (decided by the planner, savers.py) the embedding and the final norm with lm_head are FSDP
units of their own (the worker's jobs/model/parallelize.root_units): the embedding reshards after its forward like
the layers, the norm + lm_head unit stays gathered from its forward into its own backward (the backward starts
there: its own moment, "backward, lm_head") and is resharded and reduce-scattered right after it, so neither it
nor the lm_head gradient is held through the layers' backward; the embedding is prefetched during the first
layer's backward and reduce-scattered at the end. Tied embeddings are one parameter, one unit: the worker keeps
them with the root, and so does the plan. With train.loss: chunked the logits are never held whole:
the loss moment holds one chunk of core/savers.LOSS_CHUNK_TOKENS positions (and the lm_head, which the chunks use).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from fsdpjob.orchestrator.core.savers import LOSS_CHUNK_TOKENS
from fsdpjob.orchestrator.core.units import count_text, params_text, size_text, unit_for

from .activations import all_kept, kept, layer_activations, layer_mode, recomputed
from .lora import NF4_BYTES, dequant_bytes, held_bytes, trainable
from .modelshape import ModelShape, ParamCount
from .setup import Setup

# oneDNN's buffers for bf16 matmuls on a CPU it runs them on (core/hostcpu.py): 9.0-9.8 MiB of RSS on AVX-512
# (bench/plan_accuracy.py's S cases with and without torch.backends.mkldnn, glibc's mmap threshold frozen), whatever
# the model size. Made once and kept, so the allocator's slack does not grow with them (Item.kept).
CPU_BF16_KERNEL_BYTES = 10 * 1024**2
_DTYPE_NAMES = {2: "bf16", 4: "fp32"}


@dataclass(frozen=True)
class Item:
    name: str
    bytes: int
    note: str = ""
    kept: bool = False  # allocated once and never freed: no churn, so no allocator slack on it


@dataclass(frozen=True)
class Moment:
    """One moment of a training step and what is alive then, per rank."""

    name: str
    items: tuple[Item, ...]

    @property
    def bytes(self) -> int:
        return sum(i.bytes for i in self.items)


def loss_positions(u: Setup) -> int:
    """Positions whose logits exist together in the loss: the micro-batch's, or one chunk of them."""
    t = u.rows * u.seq_len
    return min(t, LOSS_CHUNK_TOKENS) if u.chunked_loss else t


def _state(tr, u: Setup) -> list[Item]:
    m, w, on_device = u.model_bytes, u.shard_degree, not u.cpu_offload
    shard, trained_shard = math.ceil(tr.weights / w), math.ceil(tr.trained / w)
    frozen = f", {params_text(tr.trained)} of them train (LoRA)" if tr.is_lora else ""
    four_bit = f", {params_text(tr.quantized)} of them in 4 bits ({NF4_BYTES:.3f} B)" if tr.quantized else ""
    return [
        Item("parameters", on_device * held_bytes(shard, math.ceil(tr.quantized / w), m),
             f"{params_text(tr.weights)} params x {m} B / {count_text(w, 'shard')}{frozen}{four_bit}"),
        Item("AdamW state", on_device * 2 * trained_shard * u.moment_bytes,
             f"exp_avg + exp_avg_sq, {u.moment_bytes} B each"),
        Item("reference model (live)", on_device * shard * m * u.reference_copy,
             "a frozen sharded copy of the starting weights (reference: cached, or grpo.beta 0: none)"),
    ]


def step_moments(s: ModelShape, p: ParamCount, u: Setup) -> tuple[list[Item], list[Moment]]:
    """The sharded state on the device (params, AdamW) and what each moment of a step adds, per rank."""
    m, c, r, w = u.model_bytes, u.compute_bytes, u.reduce_bytes, u.shard_degree
    tr = trainable(s, p, u.lora, u.quantize)
    on_device = not u.cpu_offload
    trained_shard = math.ceil(tr.trained / w)
    grads = Item("gradients", on_device * trained_shard * m, f"sharded, {m} B")
    early_grads = replace(grads, bytes=grads.bytes * (u.grad_accum > 1), note="held across micro-batches")
    if u.grad_accum > 1 and u.defer_grad_sync:
        early_grads = Item("accumulated gradients", tr.trained * r,
                           f"unsharded {_DTYPE_NAMES[r]}, held across micro-batches (reduce-scatter on the last only)")
    # The first layer's own shard of gradients comes only from its reduce-scatter, after its backward.
    other_grads = replace(grads, bytes=on_device * (trained_shard - math.ceil(tr.layer_trained / w)) * m,
                          note=f"sharded, {m} B, every layer's but the first")
    gathered = Item("layers kept gathered",
                    s.layers * held_bytes(tr.layer_weights, tr.layer_quantized, c) * (not u.reshard),
                    "fsdp.reshard_after_forward: false")
    kernels = Item("bf16 kernel buffers", CPU_BF16_KERNEL_BYTES * (not u.on_gpu and c == 2 and u.onednn_bf16),
                   "oneDNN (measured)", kept=True)
    root = _root_items(s, p, u)
    saved, logits = _saved_activations(s, u), _logits_held(s, u)
    loss = Item("loss", (12 + c) * loss_positions(u) * s.vocab,
                "logits + fp32 log-softmax and gradients" + (f", one chunk of {loss_positions(u)} positions"
                                                             if u.chunked_loss else ""))
    moments = [
        Moment("forward end (loss)", (early_grads, saved, gathered, *_listed(root["forward"]), loss, kernels)),
        *([Moment("backward, lm_head", (early_grads, saved, gathered, *root["head"], logits,
                                         Item("logits gradient", loss_positions(u) * s.vocab * c), kernels))]
          if root["head"] else []),
        Moment("backward, last layer", (early_grads, saved, gathered, root["layers"], root["head_grad"], logits,
                                        *_layer_transients(s, p, u, s.layers - 1), kernels)),
        # With one micro-batch the first layer's backward runs with every other layer's gradients already
        # reduce-scattered: all sharded gradients, the root and its head gradient, the first layer's saved
        # activations and its transients are alive together.
        Moment("backward, first layer", (other_grads, _one_layer_activations(s, u), root["first"], root["head_grad"],
                                         logits, *_layer_transients(s, p, u, 0), kernels)),
        Moment("backward end", (grads, root["grads"], kernels)),
        Moment("optimizer step", (grads, kernels)),
        *([_generation(s, tr, u, kernels)] if u.generation_rows else []),
    ]
    return _state(tr, u), moments


def _generation(s: ModelShape, tr, u: Setup, kernels: Item) -> Moment:
    """grpo's in-process generation (jobs/grpo/generate.py): a step's completions of this rank decoded together,
    one layer gathered at a time, the KV cache of every layer for prompt + completion, the last position's logits in
    fp32 for sampling; no activations or gradients kept (no grad)."""
    c, rows = u.compute_bytes, u.generation_rows
    cache = 2 * s.layers * rows * u.seq_len * s.kv_heads * s.head_dim * c
    return Moment("generation (grpo)", (
        Item("KV cache", cache, f"{rows} rows x {u.seq_len} positions x {s.layers} layers, keys and values"),
        Item("root gathered", tr.root_weights * c, "embedding + final norm + lm_head, compute dtype"),
        Item("layer gathered", held_bytes(tr.layer_weights, tr.layer_quantized, c), "one decoder layer at a time"),
        Item("sampling logits", rows * s.vocab * 4 * 2, "the last position's, fp32, and the sampling's copy"),
        kernels))


def _root_items(s: ModelShape, p: ParamCount, u: Setup) -> dict:
    """The root's items at each moment: held gathered from forward into backward, or (separate_root) units of
    their own that are gathered only around their own forward and backward."""
    c, r = u.compute_bytes, u.reduce_bytes
    tr = trainable(s, p, u.lora)
    whole = Item("root gathered", tr.root_weights * c, "embedding + final norm + lm_head, compute dtype")
    head_grad = Item("lm_head gradient", s.vocab * s.hidden * c * tr.head_trained,
                     "unsharded until the root's reduce-scatter")
    grads = Item("root gradients", tr.root_trained * (c + r), f"unsharded + {_DTYPE_NAMES[r]} reduce-scatter input")
    items = {"forward": whole, "layers": whole, "first": whole, "head_grad": head_grad, "grads": grads, "head": ()}
    if not u.separate_root or s.tied:  # tied: one parameter, one unit: the worker keeps it with the root
        return items
    trained_head = p.lm_head * tr.head_trained
    embedding = tr.root_weights - p.lm_head - p.final_norm  # the final norm goes with the head
    # The embedding reshards after its forward as the layers do (kept gathered with reshard_after_forward: false);
    # the norm + lm_head unit stays gathered after its forward (the backward starts with it), as torchtitan's.
    held = Item("embedding gathered", embedding * c * (not u.reshard), "its own unit, fsdp.reshard_after_forward: "
                "false")
    head = Item("lm_head gathered", (p.lm_head + p.final_norm) * c,
                "final norm + lm_head, their own unit (fsdp.separate_root), from their forward into their backward")
    return {
        "forward": [held, head], "layers": held, "head_grad": Item("lm_head gradient", 0),
        "first": Item("embedding gathered", embedding * c, "its own unit, prefetched for its backward"),
        "grads": replace(grads, bytes=(tr.root_trained - trained_head) * (c + r),
                         note="the embedding's: " + grads.note),
        "head": (held, head, Item("lm_head gradient", trained_head * (c + r), f"unsharded + {_DTYPE_NAMES[r]} "
                                  "reduce-scatter input, reduce-scattered right after its backward")),
    }


def _listed(item: Item | list[Item]) -> list[Item]:
    return item if isinstance(item, list) else [item]


def _logits_held(s: ModelShape, u: Setup) -> Item:
    if u.chunked_loss:
        return Item("logits", 0, "chunked loss: none held")
    return Item("logits", u.rows * u.seq_len * s.vocab * u.compute_bytes, "held by the loss code through backward")


_AC_NOTES = {"full": " (input, AC)", "op": " (input + matmul outputs, selective AC)", "none": ""}


def _one_layer_activations(s: ModelShape, u: Setup) -> Item:
    return Item("first layer's activations", kept(s, u, 0), "saved for its backward" + _AC_NOTES[layer_mode(s, u, 0)])


def _saved_activations(s: ModelShape, u: Setup) -> Item:
    c, t = u.compute_bytes, u.rows * u.seq_len
    total = all_kept(s, u)
    final_norm = (4 + 3 * c) * t * s.hidden
    per_layer = total // s.layers
    unit = unit_for(per_layer)
    note = f"{s.layers} layers x {size_text(per_layer, unit)} {unit[0]}"
    if u.activation_checkpointing:
        note += " (layer inputs, AC)"
    elif u.selective_ac == "op":
        note += " (inputs + matmul outputs, selective AC)"
    elif u.selective_ac is not None:
        note += f" on average (every {u.selective_ac}. layer checkpointed)"
    return Item("activations", total + final_norm, note + (", compiled blocks" if u.compile else ""))


def _layer_transients(s: ModelShape, p: ParamCount, u: Setup, index: int) -> list[Item]:
    """The decoder layer ``index`` in backward: gathered params (+ prefetched next), its gradients and working
    set, with what it recomputes."""
    tr = trainable(s, p, u.lora, u.quantize)
    c, layer, layer_grads = u.compute_bytes, tr.layer_weights, tr.layer_trained
    held = held_bytes(layer, tr.layer_quantized, c)  # a 4-bit layer is gathered as its codes and scales
    if u.reshard:
        prefetch = u.shard_degree > 1  # world size 1 copies the shard in place of an all-gather
        gathered = Item("layer gathered", (2 if prefetch else 1) * held + c * layer_grads,
                        "params + unsharded grads" + (" + prefetched next layer" if prefetch else ""))
    else:
        gathered = Item("layer gradients", c * layer_grads, "unsharded, before the reduce-scatter")
    working = layer_activations(s, u)[1]
    recompute = recomputed(s, u, index)
    return [
        gathered,
        Item("reduce-scatter buffer", u.reduce_bytes * layer_grads,
             f"previous layer's {_DTYPE_NAMES[u.reduce_bytes]} reduce-scatter input"),
        Item("layer working set", working + recompute,
             "activation gradients" + (" + recomputed layer" if recompute else "")),
        *([Item("4-bit dequantization", dequant_bytes(tr, u.model_bytes, c),
                "the largest 4-bit weight dequantized, with torchao's temporaries")] if tr.quantized else []),
    ]
