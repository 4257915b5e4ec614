"""Mixture-of-experts terms of the plan: the parameters one token runs through, and the activations top-k routing
adds to a layer (pure arithmetic, no torch).

Active parameters. A token runs through attention, the router, the shared experts and ``top_k`` of the routed
experts, not all of them: the forward's matmul FLOPs are 2 x the active parameters, so the step time (and MFU)
count those (Mixtral-8x7B: ~12.9B active of 46.7B; the memory plan still holds every expert).

Activations. transformers 5's MoE block (``*SparseMoeBlock``: router, then the fused experts over the routed
tokens) keeps, per token of a layer, for its backward:
  top_k x the expert MLP's activations  4c moe_intermediate each (gate, silu(gate), up, their product; the dense
                                         formula's one MLP counted once per routed copy of the token)
  + the shared experts'                 4c shared_intermediate
  + the router                          experts x (c + 4): its logits and their fp32 softmax
                                         + top_k x (4 + 8): routing weights (fp32) and expert indices (int64)
  + permute / unpermute                 2 top_k c h: each routed copy of the token's hidden state gathered into
                                         its expert's rows, and the expert's output before the weighted sum
The MLP's gradient working set scales the same way: 3c x tokens x top_k x moe_intermediate.
Capacity: transformers' routing is dropless (no capacity factor), so no token is dropped and no slot is padded;
the plan assumes balanced routing (a 2x imbalance moves at most the expert working set of the busiest expert, not
the kept activations, which count every routed copy once whatever expert takes it).
"""

from __future__ import annotations

from .modelshape import ModelShape, ParamCount


def is_moe(s: ModelShape) -> bool:
    return s.experts > 1


def expert_params(s: ModelShape) -> int:
    """Parameters of one routed expert (gated: gate, up, down; with their biases where the family has them)."""
    h, i = s.hidden, s.intermediate
    return (3 if s.gated_mlp else 2) * h * i + ((2 * i if s.gated_mlp else i) + h) * s.mlp_bias


def inactive_params(s: ModelShape) -> int:
    """Parameters of the routed experts a token does not run through, over every layer: (experts - top_k) x one
    expert per layer; 0 for dense models."""
    if not is_moe(s) or s.estimate is not None:  # an estimate (12 h^2 per layer) counts no experts
        return 0
    return s.layers * (s.experts - min(s.top_k, s.experts)) * expert_params(s)


def active_params(s: ModelShape, p: ParamCount) -> int:
    """Parameters one token runs through: all of them less the routed experts it skips."""
    return p.total - inactive_params(s)


def moe_mlp_activations(s: ModelShape, c: int, fused: bool) -> int:
    """Bytes one token keeps in one MoE layer's MLP for backward (replaces the dense formula's one MLP; see the
    module's docstring); ``fused``: compiled blocks keep gate and up only (2c per intermediate unit, not 4c)."""
    per_unit = (2 if fused else 4) * c
    mlp = per_unit * (s.top_k * s.intermediate + s.shared_expert)
    router = s.experts * (c + 4) + s.top_k * (4 + 8)
    permute = 2 * s.top_k * c * s.hidden
    return mlp + router + permute


def mlp_width(s: ModelShape) -> int:
    """The MLP's intermediate units one token runs through: top_k experts and the shared ones (dense: one MLP)."""
    return s.top_k * s.intermediate + s.shared_expert if is_moe(s) else s.intermediate
