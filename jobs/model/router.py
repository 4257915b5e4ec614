"""Mixture-of-experts routers during SFT training: the auxiliary load-balancing loss and the router metrics.

The SFT step computes its own loss from the logits (jobs/step.py), so the load-balancing loss that transformers
adds inside its forward when ``output_router_logits`` is set never reaches it. A RouterTap hooks every router of
the model (transformers 5's ``*TopKRouter`` modules, which return (logits, scores, expert indices)) and, while
armed around a micro-batch's forward, keeps their logits and counts the tokens each expert receives:

- the auxiliary loss, transformers' own ``load_balancing_loss_func`` (Switch Transformer's: experts x the sum over
  experts of the share of routed slots it receives x its mean router probability, over every layer's tokens), added
  to the training loss times ``router_aux_loss_coef`` where the config sets ``output_router_logits`` (the families
  that define it: Mixtral, Qwen3-MoE, OLMoE, gpt-oss; DeepSeek-V3 balances with a bias instead and has no such
  loss: metrics only);
- per layer, the load imbalance: the most-loaded expert's routed tokens over the mean per expert (1 is perfect
  balance, ``experts / top_k`` the worst), summed over the logged step's micro-batches and ranks.

Every position of a micro-batch counts, padding included (the packed batches carry no attention mask).
Only armed forwards record: evaluation, reference forwards and activation checkpointing's recompute in backward
leave the tap alone.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

ROUTER_CLASS_SUFFIXES = ("TopKRouter", "TopkRouter")
_ATTRIBUTE = "_fsdpjob_router_tap"


def find_routers(model: nn.Module) -> list[nn.Module]:
    """The model's expert routers, in layer order."""
    return [m for m in model.modules() if type(m).__name__.endswith(ROUTER_CLASS_SUFFIXES)]


def aux_coefficient(config) -> float:
    """The weight of the load-balancing loss in training: ``router_aux_loss_coef`` where the config turns
    ``output_router_logits`` on, else 0 (transformers' own rule)."""
    if not getattr(config, "output_router_logits", False):
        return 0.0
    return float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0)


def load_balancing_loss(logits: list[torch.Tensor], top_k: int) -> torch.Tensor:
    """transformers' load-balancing loss over the layers' router logits (tokens x experts each)."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    return load_balancing_loss_func(tuple(logits), logits[0].shape[-1], top_k)


class RouterTap:
    """Forward hooks on a model's routers; see the module's docstring."""

    def __init__(self, model: nn.Module):
        self.routers = find_routers(model)
        self.coef = aux_coefficient(getattr(model, "config", None))
        self.armed = False
        self._logits: list[torch.Tensor] = []
        self._top_k = 1
        self.counts: torch.Tensor | None = None  # layers x experts, routed slots since the last read
        self.aux_sum = torch.zeros(())
        self.micro_batches = 0
        for layer, router in enumerate(self.routers):
            router.register_forward_hook(self._hook(layer))

    def _hook(self, layer: int):
        def record(module, args, output) -> None:
            if not self.armed:
                return
            logits, indices = output[0], output[-1]
            self._logits.append(logits)
            self._top_k = indices.shape[-1]
            experts = logits.shape[-1]
            if self.counts is None:
                self.counts = torch.zeros(len(self.routers), experts, device=logits.device)
            self.counts[layer] += torch.bincount(indices.detach().reshape(-1), minlength=experts).float()

        return record

    def arm(self) -> None:
        self.armed, self._logits = True, []

    def collect(self) -> torch.Tensor | None:
        """Disarm; the micro-batch's auxiliary loss (unweighted, with its graph), None when no router ran."""
        self.armed = False
        logits, self._logits = self._logits, []
        if not logits:
            return None
        aux = load_balancing_loss(logits, self._top_k)
        self.aux_sum = self.aux_sum.to(aux.device) + aux.detach().float()
        self.micro_batches += 1
        return aux

    def read(self) -> dict[str, float]:
        """The router metrics since the last read, over every rank (a collective: every rank reads at the same
        steps), and reset."""
        if self.counts is None:
            return {}
        counts, self.counts = self.counts, None
        aux = torch.stack([self.aux_sum.to(counts.device), torch.tensor(float(self.micro_batches),
                                                                         device=counts.device)])
        self.aux_sum, self.micro_batches = torch.zeros(()), 0
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(counts)
            dist.all_reduce(aux)
        imbalance = (counts.max(dim=1).values / counts.mean(dim=1).clamp_min(1e-9)).tolist()
        out = {"moe_aux_loss": aux[0].item() / max(aux[1].item(), 1.0), "moe_imbalance_max": max(imbalance)}
        out.update({f"moe_imbalance_l{i}": value for i, value in enumerate(imbalance)})
        return out


def router_tap(model: nn.Module) -> RouterTap | None:
    """The model's RouterTap, made at the first call; None for a model without routers."""
    tap = getattr(model, _ATTRIBUTE, None)
    if tap is None:
        tap = RouterTap(model)
        object.__setattr__(model, _ATTRIBUTE, tap)
    return tap if tap.routers else None


_ROUTED: dict[type, type] = {}


def routed_values(tap: RouterTap, values):
    """``values`` (a StepValues) whose extra() adds the router metrics, read once with the loss."""
    base = type(values)
    if base not in _ROUTED:

        def extra(self) -> dict[str, float]:
            if self._router is None:
                self._router = self._tap.read()
            return {**base.extra(self), **self._router}

        _ROUTED[base] = type(f"Routed{base.__name__}", (base,), {"extra": extra})
    values.__class__ = _ROUTED[base]
    values._tap, values._router = tap, None
    return values


def aux_term(tap: RouterTap | None, micro_batches: int) -> torch.Tensor | float:
    """What a micro-batch adds to its backward for load balancing: coef x its aux loss / micro-batches (FSDP
    averages it over ranks), 0 without a router or a coefficient."""
    if tap is None:
        return 0.0
    aux = tap.collect()
    return 0.0 if aux is None or not tap.coef else aux * (tap.coef / max(micro_batches, 1))
