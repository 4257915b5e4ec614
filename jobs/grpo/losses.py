"""GRPO's advantages, per-token loss and its reduction (grpo.loss_type), with TRL 1.16's GRPOTrainer semantics.

Pure torch: no I/O, no collectives (the caller all-reduces the few numbers these need or return), fp32 math
whatever the input dtype. The formulas follow trl/trainer/grpo_trainer.py: the advantages of
``_generate_and_score_completions`` (multi_objective_aggregation "sum_then_normalize", TRL's default) and
``_compute_loss`` with importance_sampling_level "token", no entropy mask, no off-policy mask, no vLLM
importance-sampling correction, no delta clamp (TRL's defaults); tests/worker/test_grpo_losses.py calls TRL's own
_compute_loss and nanstd to check them.

The reduction is split so that it can be summed: ``reduce`` gives one micro-batch's share of TRL's loss for the
whole step, and the shares of every micro-batch on every rank add up to it. TRL's own normalisers, per
micro-batch of B completions, with GA micro-batches per optimizer step on each of P processes whose gradients
are averaged (DDP/FSDP), and the Trainer's own division by GA switched off (loss_is_scaled_for_ga = True):
- grpo: mean over the micro-batch's completions of (sum of its tokens' losses / its token count) / GA;
- bnpo: the micro-batch's summed loss / its token count / GA (the "local batch" is the micro-batch);
- dr_grpo: the micro-batch's summed loss / (B * max_completion_length) / GA;
- dapo: the micro-batch's summed loss / (num_items_in_batch / P * GA / steps_per_generation), where
  num_items_in_batch is the completion tokens of the whole generation round over all processes.
Averaged over the P processes and summed over the GA micro-batches, with B * GA * P = the step's completions
(``completions_global``), these are the shares below. TRL's per-micro-batch normalisers weigh micro-batches
equally, so grpo and bnpo are TRL's exactly when every micro-batch has the same number of rows (TRL's always do);
with unequal micro-batches, these weigh each micro-batch by its rows (the natural generalisation).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

LOSS_TYPES = ("grpo", "dr_grpo", "dapo", "bnpo")
SCALES = ("group", "batch", "none")
STD_EPS = 1e-4  # TRL: advantages / (std + 1e-4)
# The sums metric_sums returns, in its order; the last is the count each is divided by.
METRIC_SUM_NAMES = ("kl", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "entropy",
                    "tokens")


class TokenTerms(NamedTuple):
    per_token: torch.Tensor  # [N, T] fp32: the clipped surrogate's loss (+ beta * KL); differentiable; not masked
    kl: torch.Tensor | None  # [N, T] fp32 detached, None when beta == 0
    low_clipped: torch.Tensor  # [N, T] bool: ratio < 1 - epsilon with a negative advantage
    high_clipped: torch.Tensor  # [N, T] bool: ratio > 1 + epsilon_high with a positive advantage


def reward_moments(rewards: torch.Tensor) -> torch.Tensor:
    """[count, sum, sum of squares] of this rank's rewards in float64: all-reduce (SUM) them over the ranks and
    give the result to ``batch_std`` for scale_rewards "batch"."""
    r = rewards.detach().to(torch.float64)
    return torch.stack([torch.tensor(float(r.numel()), dtype=torch.float64, device=r.device), r.sum(), (r * r).sum()])


def batch_std(moments: torch.Tensor) -> torch.Tensor:
    """The standard deviation of the whole batch's rewards from their summed ``reward_moments``: Bessel-corrected
    (n - 1), as TRL's nanstd; 0 for a batch of one (TRL's zeros_like)."""
    n, total, squares = moments.unbind()
    if n <= 1:
        return torch.zeros((), dtype=torch.float32, device=moments.device)
    variance = (squares - total * total / n).clamp(min=0) / (n - 1)
    return variance.sqrt().to(torch.float32)


def group_advantages(rewards: torch.Tensor, num_generations: int, scale: str, *,
                     batch_std: torch.Tensor | None = None) -> torch.Tensor:
    """[N] advantages of [N] rewards whose groups are consecutive rows (prompt i: rows i*G .. i*G+G-1).

    reward - its group's mean, divided by (std + 1e-4) where std is the group's (scale "group") or the whole
    batch's (scale "batch"), or not divided ("none"). Standard deviations are Bessel-corrected (n - 1) as TRL's
    nanstd. TRL computes these over the global batch gathered from every process; here a group is always on one
    rank (the caller guarantees it), so the group statistics are local, but the batch's std spans every rank:
    the caller passes it as ``batch_std`` (reward_moments all-reduced, then batch_std); without it, this rank's
    rewards' std (right on one rank only). Rewards are finite here: the reward functions' results are checked
    before (TRL's NaN handling for unscorable completions is not needed).
    """
    if scale not in SCALES:
        raise ValueError(f"scale_rewards {scale!r} is not one of {SCALES}")
    if rewards.dim() != 1 or num_generations < 1 or rewards.numel() % num_generations:
        raise ValueError(f"rewards [N] with N a multiple of num_generations ({num_generations}) expected, "
                         f"got {tuple(rewards.shape)}")
    r = rewards.detach().to(torch.float32)
    grouped = r.view(-1, num_generations)
    advantages = (grouped - grouped.mean(dim=1, keepdim=True)).reshape(-1)
    if scale == "group":
        std = grouped.std(dim=1, correction=1) if num_generations > 1 else grouped.new_zeros(len(grouped))
        return advantages / (std.repeat_interleave(num_generations) + STD_EPS)
    if scale == "batch":
        if batch_std is None:
            batch_std = r.std(correction=1) if r.numel() > 1 else r.new_zeros(())
        return advantages / (batch_std.to(r) + STD_EPS)
    return advantages


def loss_terms(logps: torch.Tensor, old_logps: torch.Tensor | None, ref_logps: torch.Tensor | None,
               advantages: torch.Tensor, *, epsilon: float, epsilon_high: float | None, beta: float) -> TokenTerms:
    """Per-token loss of the clipped surrogate, TRL's: ratio = exp(logps - old_logps) (``old_logps`` None: the
    policy that generated is this one, logps detached, ratio 1 with the policy gradient, as TRL when it skips
    old_per_token_logps), loss = -min(ratio * A, clip(ratio, 1 - epsilon, 1 + epsilon_high) * A), plus
    beta * KL with KL = exp(ref - logp) - (ref - logp) - 1 (k3) when beta > 0. Inputs [N, T] (advantages [N]);
    positions outside the completion are computed too: ``reduce`` masks them."""
    logps = logps.float()
    old = logps.detach() if old_logps is None else old_logps.detach().float()
    high = epsilon if epsilon_high is None else epsilon_high
    adv = advantages.detach().float().unsqueeze(1)
    ratio = torch.exp(logps - old)
    clipped = torch.clamp(ratio, 1 - epsilon, 1 + high)
    per_token = -torch.min(ratio * adv, clipped * adv)
    kl = None
    if beta != 0.0:
        if ref_logps is None:
            raise ValueError("beta > 0 needs the reference's log-probabilities")
        delta = ref_logps.detach().float() - logps
        kl_grad = torch.exp(delta) - delta - 1
        per_token = per_token + beta * kl_grad
        kl = kl_grad.detach()
    return TokenTerms(per_token, kl, (ratio < 1 - epsilon) & (adv < 0), (ratio > 1 + high) & (adv > 0))


def reduce(per_token: torch.Tensor, mask: torch.Tensor, loss_type: str, *, completions_global: int,
           tokens_global: float, max_new_tokens: int) -> torch.Tensor:
    """This micro-batch's share of TRL's loss for the whole optimizer step (all micro-batches, all ranks): summed
    over every micro-batch on every rank, the shares are TRL's loss (see the module's docstring).

    ``mask`` [N, T]: the completion's tokens up to and including EOS. ``completions_global``: completions trained
    on in this optimizer step over all ranks. ``tokens_global`` (dapo): the completion tokens of this step over
    all ranks; TRL's is the whole generation round's tokens divided by grpo.steps_per_generation (equal when each
    step has its own generations): pass that to match TRL with steps_per_generation > 1. bnpo normalises by this
    micro-batch's own tokens (TRL's "local batch"): pass the micro-batch whole. The caller multiplies by the world
    size before backward when FSDP averages the gradients over the ranks.
    """
    m = mask.to(per_token.dtype)
    masked = per_token * m
    if loss_type == "grpo":
        return (masked.sum(-1) / m.sum(-1).clamp(min=1.0)).sum() / completions_global
    if loss_type == "bnpo":
        return masked.sum() / m.sum().clamp(min=1.0) * (per_token.shape[0] / completions_global)
    if loss_type == "dr_grpo":
        return masked.sum() / (completions_global * max_new_tokens)
    if loss_type == "dapo":
        return masked.sum() / max(float(tokens_global), 1.0)
    raise ValueError(f"loss_type {loss_type!r} is not one of {LOSS_TYPES}")


def metric_sums(terms: TokenTerms, mask: torch.Tensor, entropy: torch.Tensor | None = None) -> torch.Tensor:
    """[6] fp32 sums over this micro-batch's completion tokens, in METRIC_SUM_NAMES' order: KL (0 when beta is 0),
    low-, high- and region-clipped tokens, the policy's entropy ([N, T] per token, 0 when not given) and the token
    count. Add them over micro-batches and all-reduce (SUM) them over ranks, then ``metric_means``."""
    m = mask.to(torch.float32)
    region = terms.low_clipped | terms.high_clipped
    kl = (terms.kl * m).sum() if terms.kl is not None else m.new_zeros(())
    entropy_sum = (entropy.float() * m).sum() if entropy is not None else m.new_zeros(())
    return torch.stack([kl, (terms.low_clipped * m).sum(), (terms.high_clipped * m).sum(), (region * m).sum(),
                        entropy_sum, m.sum()]).detach()


def nanstd(values: torch.Tensor) -> torch.Tensor:
    """The Bessel-corrected standard deviation of the values that are not NaN (TRL's nanstd: NaN for fewer than
    two)."""
    v = values.double()
    count = (~torch.isnan(v)).sum()
    variance = torch.nanmean((v - torch.nanmean(v)) ** 2) * count / (count - 1)
    return variance.sqrt().float()


def metric_means(sums: torch.Tensor, *, beta: float) -> dict[str, float]:
    """TRL's metrics from the step's summed ``metric_sums``: the token-weighted means over the step (TRL logs
    the mean over micro-batches of each micro-batch's global token-weighted mean: equal when the micro-batches
    hold as many tokens). ``kl`` only when beta > 0, as TRL."""
    values = sums.tolist()
    count = max(values[-1], 1.0)
    means = {name: value / count for name, value in zip(METRIC_SUM_NAMES[:-1], values[:-1], strict=True)}
    if beta == 0.0:
        del means["kl"]
    return means
