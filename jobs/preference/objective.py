"""Each preference method's loss of a micro-batch, from the policy's answer log-probabilities (and the
reference's), with the ecosystem's metrics (TRL's names) as sums over the micro-batch's pairs."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from fsdpjob.orchestrator.core.jobspec.methods import DpoSpec, OrpoSpec

from .losses import dpo_loss, orpo_loss, pair_metrics, rpo_term

# The metrics a pair method logs, in this order (metrics.jsonl, the trackers).
PAIR_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
                "logps/rejected")


@dataclass(frozen=True)
class BatchLoss:
    losses: torch.Tensor  # [B] per pair, with autograd
    metric_sums: torch.Tensor  # [len(PAIR_METRICS)] fp32, detached: sums over the micro-batch's pairs


# (policy logps [2B], token counts [2B], reference logps [B, 2] or None) -> BatchLoss
Objective = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], BatchLoss]


def _sums(loss, chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    means = pair_metrics(loss, chosen.detach(), rejected.detach())
    return torch.stack([means[name].float() for name in PAIR_METRICS]) * chosen.numel()


def dpo_objective(options: DpoSpec) -> Objective:
    def objective(logps: torch.Tensor, counts: torch.Tensor, reference: torch.Tensor | None) -> BatchLoss:
        chosen, rejected = logps.chunk(2)
        chosen_tokens, rejected_tokens = counts.chunk(2)
        reference = reference.to(logps.device)
        out = dpo_loss(chosen, rejected, reference[:, 0], reference[:, 1], beta=options.beta,
                       loss_type=options.loss_type, label_smoothing=options.label_smoothing,
                       chosen_tokens=chosen_tokens, rejected_tokens=rejected_tokens)
        losses = out.losses
        if options.rpo_alpha is not None:
            losses = losses + options.rpo_alpha * rpo_term(chosen, chosen_tokens)
        return BatchLoss(losses, _sums(out, chosen, rejected))
    return objective


def orpo_objective(options: OrpoSpec) -> Objective:
    def objective(logps: torch.Tensor, counts: torch.Tensor, _reference: torch.Tensor | None) -> BatchLoss:
        chosen, rejected = logps.chunk(2)
        chosen_tokens, rejected_tokens = (c.clamp(min=1) for c in counts.chunk(2))
        out = orpo_loss(chosen / chosen_tokens, rejected / rejected_tokens, beta=options.beta)
        # ORPO is the chosen answer's SFT loss (its tokens' mean NLL) plus the odds-ratio term.
        losses = -chosen / chosen_tokens + out.losses
        return BatchLoss(losses, _sums(out, chosen, rejected))
    return objective


def objective_for(method: str, options) -> Objective:
    return {"dpo": dpo_objective, "orpo": orpo_objective}[method](options)


def needs_reference(method: str) -> bool:
    return method in ("dpo", "kto")
