"""Each preference method's loss of a micro-batch, from the policy's answer log-probabilities (and the
reference's), with the ecosystem's metrics (TRL's names) as sums the step adds up over micro-batches and ranks.

An objective names its metrics itself: each logged metric is the ratio of one of its sums to one of its counts
(kto's rewards/chosen: the desirable answers' summed rewards over their number, as TRL averages them), or to the
global batch's examples (dpo's and orpo's per-pair means). Every builder takes (options, rank_mean) (only kto's
uses the ranks' mean); which builder a method trains with is its row's (jobs/methods.py)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from fsdpjob.orchestrator.core.jobspec.methods import DpoSpec, KtoSpec, OrpoSpec, RewardSpec

from .losses import dpo_loss, kto_kl, kto_loss, orpo_loss, pair_metrics, reward_loss, rpo_term

RankMean = Callable[[torch.Tensor], torch.Tensor]  # a value's mean over every rank (a collective)

# The metrics a pair method logs, in this order (metrics.jsonl, the trackers).
PAIR_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
                "logps/rejected")
# ORPO's own, after the pair metrics (TRL's ORPOTrainer names): the chosen rows' NLL, the mean of
# logsigmoid(log-odds) and of the log-odds.
ORPO_METRICS = ("nll_loss", "log_odds_ratio", "log_odds_chosen")
# kto's sums, in the order of its metric_sums: the KL of each micro-batch (already the ranks' mean) and the
# micro-batches counted, the desirable ("chosen") and undesirable ("rejected") answers' rewards, their numbers
# and their summed log-probabilities.
KTO_SUMS = ("kl", "micro_batches", "rewards/chosen", "chosen", "rewards/rejected", "rejected", "logps/chosen",
            "logps/rejected")

# A reward model's, per-pair means: TRL's RewardTrainer names (accuracy, margin, mean_reward), then the pair methods'
# rewards/* on the scores (the same values under the names the other methods log). TRL's min_reward and max_reward
# are not sums over pairs and are left out.
REWARD_METRICS = ("accuracy", "margin", "mean_reward", "rewards/chosen", "rewards/rejected", "rewards/accuracies",
                  "rewards/margins")


class Ratio(NamedTuple):
    """A logged metric: metric_sums[numerator] over metric_sums[denominator], or over the global batch's examples
    where the denominator is None. A metric whose count is 0 in a step is not logged (TRL logs it only then)."""

    name: str
    numerator: int
    denominator: int | None = None


@dataclass(frozen=True)
class BatchLoss:
    losses: torch.Tensor  # [B] per example (a pair, or kto's answer), with autograd
    metric_sums: torch.Tensor  # [Objective.sums] fp32, detached: sums over the micro-batch


# (policy logps [2B], token counts [2B], reference logps [B, 2] or None, the micro-batch) -> BatchLoss
LossOf = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None, object], BatchLoss]


@dataclass(frozen=True)
class Objective:
    loss: LossOf
    sums: int  # metric_sums' length
    metrics: tuple[Ratio, ...]  # the logged metrics, in their order

    def __call__(self, logps: torch.Tensor, counts: torch.Tensor, reference: torch.Tensor | None,
                 batch) -> BatchLoss:
        return self.loss(logps, counts, reference, batch)


def _pair_objective(loss: LossOf) -> Objective:
    return Objective(loss, len(PAIR_METRICS), tuple(Ratio(name, i) for i, name in enumerate(PAIR_METRICS)))


def _sums(loss, chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    means = pair_metrics(loss, chosen.detach(), rejected.detach())
    return torch.stack([means[name].float() for name in PAIR_METRICS]) * chosen.numel()


def dpo_objective(options: DpoSpec, _rank_mean: RankMean | None = None) -> Objective:
    def objective(logps: torch.Tensor, counts: torch.Tensor, reference: torch.Tensor | None, _batch) -> BatchLoss:
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
    return _pair_objective(objective)


def orpo_objective(options: OrpoSpec, _rank_mean: RankMean | None = None) -> Objective:
    """ORPO as TRL 1.16's ORPOTrainer (batches.orpo_logps' forward): the NLL of the micro-batch's chosen rows, a
    mean over all their tokens, prompt and answer (TRL's cross-entropy over the input ids), minus the mean of
    beta logsigmoid(log-odds) of the answers' per-token mean log-probabilities; ``logps/*`` are those means, as TRL
    logs them, and nll_loss, log_odds_ratio and log_odds_chosen its other metrics."""
    def objective(logps: torch.Tensor, counts: torch.Tensor, _reference: torch.Tensor | None, _batch) -> BatchLoss:
        answers, rows = logps.unbind(1)
        chosen, rejected = (a / c.clamp(min=1) for a, c in zip(answers.chunk(2), counts[:, 0].chunk(2)))
        out = orpo_loss(chosen, rejected, beta=options.beta)
        pairs = chosen.numel()
        nll = -rows.float().sum() / counts[:, 1].sum().clamp(min=1)  # the micro-batch's, spread over its pairs
        losses = nll.expand(pairs) + out.losses
        odds = torch.stack([nll.detach(), F.logsigmoid(out.log_odds_ratio).mean(), out.log_odds_ratio.mean()])
        return BatchLoss(losses, torch.cat([_sums(out, chosen, rejected), odds * pairs]))
    names = PAIR_METRICS + ORPO_METRICS
    return Objective(objective, len(names), tuple(Ratio(name, i) for i, name in enumerate(names)))


def kto_objective(options: KtoSpec, rank_mean: RankMean) -> Objective:
    """KTO as TRL 1.16's KTOTrainer: the micro-batch's KL estimate from its mismatched rows (ktobatch.py),
    averaged over the ranks with ``rank_mean`` (a collective: every rank calls it once per micro-batch), then
    clamped at 0 inside kto_loss."""
    def objective(logps: torch.Tensor, _counts: torch.Tensor, reference: torch.Tensor | None, batch) -> BatchLoss:
        answers, kl_rows = logps.chunk(2)  # batches.answer_rows: the answers, then their KL rows
        reference = reference.to(logps.device)
        kl = rank_mean(kto_kl(kl_rows, reference[:, 1]))
        desirable = batch.desirable.to(logps.device)
        out = kto_loss(answers, reference[:, 0], desirable, kl, beta=options.beta,
                       desirable_weight=options.desirable_weight, undesirable_weight=options.undesirable_weight)
        good, bad = desirable.float(), (~desirable).float()
        policy = answers.detach().float()
        sums = torch.stack([kl.clamp(min=0), torch.ones_like(kl), (out.rewards * good).sum(), good.sum(),
                            (out.rewards * bad).sum(), bad.sum(), (policy * good).sum(), (policy * bad).sum()])
        return BatchLoss(out.losses, sums)
    names = dict(zip(KTO_SUMS, range(len(KTO_SUMS))))
    return Objective(objective, len(KTO_SUMS), tuple(
        Ratio(name, names[name], names[count]) for name, count in (
            ("kl", "micro_batches"), ("rewards/chosen", "chosen"), ("rewards/rejected", "rejected"),
            ("logps/chosen", "chosen"), ("logps/rejected", "rejected"))))


def reward_objective(_options: RewardSpec, _rank_mean: RankMean | None = None) -> Objective:
    """Bradley-Terry on the rows' scores (batches.reward_scores: chosen rows, then rejected), with each pair's
    margin where reward.margin_field gives one (the batch's margins)."""
    def objective(scores: torch.Tensor, _counts: torch.Tensor, _reference: torch.Tensor | None, batch) -> BatchLoss:
        chosen, rejected = scores.float().chunk(2)
        margins = batch.margins.to(scores.device) if batch.margins is not None else None
        losses = reward_loss(chosen, rejected, margins)
        c, r = chosen.detach(), rejected.detach()
        accuracy, margin = (c > r).float(), c - r
        per_pair = torch.stack([accuracy, margin, (c + r) / 2, c, r, accuracy, margin])  # REWARD_METRICS' order
        return BatchLoss(losses, per_pair.sum(dim=1))
    return Objective(objective, len(REWARD_METRICS), tuple(Ratio(name, i) for i, name in enumerate(REWARD_METRICS)))
