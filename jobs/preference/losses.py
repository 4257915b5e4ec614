"""The preference methods' losses (train.method dpo | orpo | kto | reward) on per-answer log-probabilities.

Pure torch: no I/O, no collectives (the caller all-reduces what these return), fp32 math whatever the input
dtype. The formulas and the names follow TRL 1.16 (trl/trainer/dpo_trainer.py DPOTrainer._compute_loss,
trl/trainer/kto_trainer.py KTOTrainer._compute_loss, trl/experimental/orpo/orpo_trainer.py
ORPOTrainer.odds_ratio_loss, trl/trainer/reward_trainer.py RewardTrainer.compute_loss), so a run's numbers can
be compared with a TRL run's; tests/worker/test_preference_losses.py calls TRL's own code to check them.

Every loss is per row ([B]), not yet reduced: TRL takes the plain mean over the batch, the caller decides the
global reduction. Rewards are detached, for logging only.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from fsdpjob.jobs.data.examples import IGNORE

DPO_LOSS_TYPES = ("sigmoid", "ipo", "hinge", "robust", "sigmoid_norm")
# The loss types that divide the log-ratios by the answers' token counts (TRL: completion_mask.sum(1)).
_PER_TOKEN_TYPES = ("ipo", "sigmoid_norm")


class PairLoss(NamedTuple):
    losses: torch.Tensor  # [B] fp32, differentiable
    chosen_rewards: torch.Tensor  # [B] fp32, detached
    rejected_rewards: torch.Tensor  # [B] fp32, detached


class OrpoLoss(NamedTuple):
    losses: torch.Tensor  # [B]: -beta * logsigmoid(log_odds_ratio); the caller adds the NLL on chosen
    chosen_rewards: torch.Tensor  # [B] beta * mean logp of chosen, detached
    rejected_rewards: torch.Tensor  # [B]
    log_odds_ratio: torch.Tensor  # [B] detached: log(odds(chosen) / odds(rejected)); TRL logs its mean as
    #                               "log_odds_chosen" and the mean of logsigmoid of it as "log_odds_ratio"


class KtoLoss(NamedTuple):
    losses: torch.Tensor  # [B] fp32, weighted, in the input's row order
    rewards: torch.Tensor  # [B] beta * (policy - reference) logps, detached


def answer_logps(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: the summed log-probability of the target tokens (fp32) and their count (long).

    The project's convention (jobs/step.py train_step): position t's logits predict labels[:, t + 1]; labels
    hold IGNORE where a position is not a target. Only the target positions' logits are upcast: a preference
    row is mostly prompt, and an fp32 copy of the whole [B, L, V] logits (plus the softmax autograd keeps) is
    what runs a large vocabulary out of memory. cross_entropy's reduction="none" is -logp per target without a
    separate log_softmax tensor; gradients flow to ``logits`` (zero at the positions that are not targets).
    """
    if logits.dim() != 3 or labels.shape != logits.shape[:2]:
        raise ValueError(f"logits [B, L, V] and labels [B, L] expected, got {tuple(logits.shape)} and "
                         f"{tuple(labels.shape)}")
    targets = F.pad(labels[:, 1:], (0, 1), value=IGNORE)
    is_target = targets != IGNORE
    rows, cols = is_target.nonzero(as_tuple=True)
    token_logps = -F.cross_entropy(logits[rows, cols].float(), targets[rows, cols], reduction="none")
    sums = torch.zeros(labels.size(0), dtype=torch.float32, device=logits.device).index_add(0, rows, token_logps)
    return sums, is_target.sum(dim=1)


def _fp32(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.float() for t in tensors]


def _per_token(logratios: torch.Tensor, tokens: torch.Tensor | None, name: str) -> torch.Tensor:
    if tokens is None:
        raise ValueError(f"{name} is needed to divide the log-ratios by the answer's token count")
    return logratios / tokens.float().clamp(min=1.0)  # TRL: completion_mask.sum(dim=1).clamp(min=1.0)


def dpo_loss(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, reference_chosen: torch.Tensor,
             reference_rejected: torch.Tensor, *, beta: float, loss_type: str, label_smoothing: float = 0.0,
             chosen_tokens: torch.Tensor | None = None, rejected_tokens: torch.Tensor | None = None) -> PairLoss:
    """DPO's per-pair loss on summed answer log-probabilities, as TRL 1.16's DPOTrainer (reverse-KL f-divergence,
    no ld_alpha, no WPO weighting).

    With d = (policy_chosen - reference_chosen) - (policy_rejected - reference_rejected):

    - "sigmoid": -logsigmoid(beta d) (Rafailov et al. 2023). With ``label_smoothing`` eps > 0 it is cDPO,
      -(1 - eps) logsigmoid(beta d) - eps logsigmoid(-beta d), the form TRL's "sigmoid" had until its DPO
      rewrite; TRL 1.16's "sigmoid" ignores label_smoothing (its docs name it for "robust" and EXO only).
    - "hinge": relu(1 - beta d) (SLiC).
    - "ipo": (d_tok - 1 / (2 beta))^2, where d_tok divides each answer's log-ratio by its token count (TRL does
      this, citing the IPO authors; the paper's eq. 17 is on sequence sums).
    - "robust": (-(1 - eps) logsigmoid(beta d) + eps logsigmoid(-beta d)) / (1 - 2 eps) (Chowdhury et al. 2024),
      eps = label_smoothing in [0, 0.5).
    - "sigmoid_norm": -logsigmoid(beta d_tok), TRL 1.16's name for the length-normalised DPO.

    The per-token types need ``chosen_tokens``/``rejected_tokens`` (answer_logps' counts). Rewards are
    beta * (policy - reference) on the SUMMED log-probabilities for every type, as TRL logs them.
    """
    if loss_type not in DPO_LOSS_TYPES:
        raise ValueError(f"unknown DPO loss_type {loss_type!r}; one of {', '.join(DPO_LOSS_TYPES)}")
    if label_smoothing and loss_type not in ("sigmoid", "robust"):
        raise ValueError(f"label_smoothing applies to the sigmoid and robust losses, not {loss_type!r}")
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing must lie in [0, 0.5), got {label_smoothing}")
    pc, pr, rc, rr = _fp32(policy_chosen, policy_rejected, reference_chosen, reference_rejected)
    chosen_logratios = pc - rc
    rejected_logratios = pr - rr
    if loss_type in _PER_TOKEN_TYPES:
        delta = (_per_token(chosen_logratios, chosen_tokens, "chosen_tokens")
                 - _per_token(rejected_logratios, rejected_tokens, "rejected_tokens"))
    else:
        delta = chosen_logratios - rejected_logratios
    eps = label_smoothing
    if loss_type in ("sigmoid", "sigmoid_norm"):
        losses = -F.logsigmoid(beta * delta)
        if eps:
            losses = losses * (1 - eps) - F.logsigmoid(-beta * delta) * eps
    elif loss_type == "hinge":
        losses = torch.relu(1 - beta * delta)
    elif loss_type == "ipo":
        losses = (delta - 1 / (2 * beta)) ** 2
    else:  # robust
        clean = -(1 - eps) * F.logsigmoid(beta * delta)
        flipped = -eps * F.logsigmoid(-beta * delta)
        losses = (clean - flipped) / (1 - 2 * eps)
    return PairLoss(losses, beta * chosen_logratios.detach(), beta * rejected_logratios.detach())


def rpo_term(policy_chosen: torch.Tensor, chosen_tokens: torch.Tensor) -> torch.Tensor:
    """The NLL on the chosen answers that RPO adds, alpha times, to the DPO loss; [B].

    TRL 1.16 has no rpo_alpha any more: RPO is loss_type=["sigmoid", "sft"] with loss_weights=[1, alpha], and
    its "sft" term is the mean NLL over ALL chosen tokens of the batch (token-weighted, not a mean of per-row
    means), expanded to every row. This returns that, so ``dpo.losses.mean() + alpha * rpo.mean()`` is TRL's
    loss for the same micro-batch.
    """
    nll = -policy_chosen.float().sum() / chosen_tokens.float().sum().clamp(min=1.0)
    return nll.expand(policy_chosen.size(0))


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, in TRL's stable form: two branches at -ln 2 to avoid cancellation."""
    return torch.where(x < -0.6931471805599453, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def orpo_loss(policy_chosen_mean: torch.Tensor, policy_rejected_mean: torch.Tensor, *, beta: float) -> OrpoLoss:
    """ORPO's odds-ratio term (Hong et al. 2024, eqs. 4 and 7) on per-token MEAN answer log-probabilities.

    log_odds = (c - r) - (log(1 - exp(c)) - log(1 - exp(r))); loss = -beta logsigmoid(log_odds). TRL returns
    +beta logsigmoid(log_odds) and subtracts its mean from the NLL; the sign here makes it a loss to add.
    The NLL on the chosen answer is the caller's (TRL's experimental ORPOTrainer takes it over the prompt's
    tokens too: labels are the input ids wherever the attention mask is set).
    """
    chosen, rejected = _fp32(policy_chosen_mean, policy_rejected_mean)
    log_odds = (chosen - rejected) - (_log1mexp(chosen) - _log1mexp(rejected))
    losses = -beta * F.logsigmoid(log_odds)
    return OrpoLoss(losses, beta * chosen.detach(), beta * rejected.detach(), log_odds.detach())


def kto_kl(policy_kl_logps: torch.Tensor, reference_kl_logps: torch.Tensor) -> torch.Tensor:
    """The batch's KL estimate for KTO: the mean log-ratio of the mismatched (prompt, other answer) rows; 0-dim,
    fp32, detached.

    NOT clamped here: TRL averages the ranks' unclamped means (gather_for_metrics(kl).mean()) and clamps the
    average at 0, so the caller all-reduces (averages) this value and kto_loss clamps it.
    """
    policy, reference = _fp32(policy_kl_logps, reference_kl_logps)
    return (policy - reference).mean().detach()


def kto_loss(policy_logps: torch.Tensor, reference_logps: torch.Tensor, desirable: torch.Tensor,
             kl: torch.Tensor | float, *, beta: float, desirable_weight: float,
             undesirable_weight: float) -> KtoLoss:
    """KTO's per-row loss (Ethayarajh et al. 2024, eq. 7), as TRL 1.16's KTOTrainer with loss_type "kto".

    With r = policy - reference (summed logps) and z = max(kl, 0), detached: desirable rows
    desirable_weight * (1 - sigmoid(beta (r - z))), undesirable rows undesirable_weight * (1 - sigmoid(beta (z - r))).
    Rows stay in input order (TRL concatenates the desirable rows first; its loss is the plain mean).
    """
    policy, reference = _fp32(policy_logps, reference_logps)
    z = torch.as_tensor(kl, dtype=torch.float32, device=policy.device).detach().clamp(min=0)
    logratios = policy - reference
    good = desirable_weight * (1 - torch.sigmoid(beta * (logratios - z)))
    bad = undesirable_weight * (1 - torch.sigmoid(beta * (z - logratios)))
    losses = torch.where(desirable.to(device=policy.device, dtype=torch.bool), good, bad)
    return KtoLoss(losses, beta * logratios.detach())


def reward_loss(chosen_scores: torch.Tensor, rejected_scores: torch.Tensor,
                margin: torch.Tensor | None = None) -> torch.Tensor:
    """Bradley-Terry's per-pair loss of a reward model, -logsigmoid(chosen - rejected - margin), as TRL 1.16's
    RewardTrainer (without its center_rewards_coefficient term)."""
    chosen, rejected = _fp32(chosen_scores, rejected_scores)
    diff = chosen - rejected
    if margin is not None:
        diff = diff - margin.float()
    return -F.logsigmoid(diff)


def pair_metrics(loss: PairLoss | OrpoLoss, policy_chosen: torch.Tensor,
                 policy_rejected: torch.Tensor) -> dict[str, torch.Tensor]:
    """The batch means TRL logs for a pair method, under TRL's names; 0-dim fp32 detached tensors, so the
    caller can all-reduce them before turning them into floats.

    "rewards/accuracies" is the share of pairs whose chosen reward is strictly above the rejected one.
    """
    chosen, rejected = loss.chosen_rewards.detach().float(), loss.rejected_rewards.detach().float()
    return {
        "rewards/chosen": chosen.mean(),
        "rewards/rejected": rejected.mean(),
        "rewards/accuracies": (chosen > rejected).float().mean(),
        "rewards/margins": (chosen - rejected).mean(),
        "logps/chosen": policy_chosen.detach().float().mean(),
        "logps/rejected": policy_rejected.detach().float().mean(),
    }
