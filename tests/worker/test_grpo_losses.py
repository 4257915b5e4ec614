"""GRPO's advantages and losses (jobs/grpo/losses.py) against TRL 1.16's own code.

The loss: TRL's GRPOTrainer._compute_loss, called unbound with a SimpleNamespace ``self`` carrying the
configuration it reads and a stand-in for _get_per_token_logps_and_entropies that returns the given per-token
log-probabilities (a leaf, so the gradients of both sides are compared). A step of P processes x GA micro-batches
is replayed as TRL runs it: each micro-batch's loss with TRL's normaliser, averaged over the processes (what
DDP/FSDP do to the gradients), summed over the micro-batches; the shares of ``reduce`` must add up to the same
loss and gradients. The advantages: TRL computes them inline in _generate_and_score_completions (a method that
generates and scores, not callable without a trainer), so the test writes out its lines for
sum_then_normalize with TRL's own nanstd (trl.trainer.utils).
"""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
from torch.testing import assert_close

from fsdpjob.jobs.grpo.losses import (
    batch_std,
    group_advantages,
    loss_terms,
    metric_means,
    metric_sums,
    reduce,
    reward_moments,
)

CPU = torch.device("cpu")
P, GA, B, T = 2, 2, 3, 7  # processes, micro-batches per step on each, rows per micro-batch, max_new_tokens


def _grpo_trainer():
    return pytest.importorskip("trl.trainer.grpo_trainer").GRPOTrainer


def _nanstd():
    return pytest.importorskip("trl.trainer.utils").nanstd


def _batch(seed: int, n: int = P * GA * B) -> dict[str, torch.Tensor]:
    """Seeded per-token log-probs of n completions of up to T tokens, an older policy and a reference near them
    (far enough that ratios leave the clip range), advantages and completion masks of 1..T tokens."""
    g = torch.Generator().manual_seed(seed)
    logps = -3 * torch.rand(n, T, generator=g)
    lengths = torch.randint(1, T + 1, (n,), generator=g)
    return {"logps": logps, "old": logps + 0.3 * torch.randn(n, T, generator=g),
            "ref": logps + 0.5 * torch.randn(n, T, generator=g), "adv": torch.randn(n, generator=g),
            "mask": (torch.arange(T)[None, :] < lengths[:, None]).long()}


def _trl_self(loss_type: str, *, beta: float, epsilon: float, epsilon_high: float | None, processes: int,
              accumulation: int, steps_per_generation: int) -> SimpleNamespace:
    """What GRPOTrainer._compute_loss reads from the trainer, with TRL's defaults for the options not tested."""
    accelerator = SimpleNamespace(device=CPU, num_processes=processes, gather=lambda t: t,
                                  gather_for_metrics=lambda t: t, reduce=lambda t, reduction: t)
    args = SimpleNamespace(use_bias_correction_kl=False, delta=None, steps_per_generation=steps_per_generation)
    return SimpleNamespace(
        model=SimpleNamespace(training=True), accelerator=accelerator, args=args, loss_type=loss_type, beta=beta,
        epsilon_low=epsilon, epsilon_high=epsilon if epsilon_high is None else epsilon_high,
        top_entropy_quantile=1.0, off_policy_mask_threshold=None, importance_sampling_level="token",
        use_vllm=False, vllm_importance_sampling_correction=False, current_gradient_accumulation_steps=accumulation,
        max_completion_length=T, _entropy_bonus_enabled=False, aux_loss_enabled=False,
        _metrics=defaultdict(lambda: defaultdict(list)))


def _trl_loss(trainer: SimpleNamespace, logps, b: dict, rows: slice, *, num_items: float, with_old: bool,
              entropy: torch.Tensor | None = None):
    """TRL's loss of one micro-batch (``rows`` of the batch), its forward giving ``entropy`` (default 0)."""
    mask = b["mask"][rows]
    entropies = torch.zeros_like(logps[rows]) if entropy is None else entropy[rows]
    trainer._get_per_token_logps_and_entropies = lambda *a, **k: (logps[rows], entropies, None)
    inputs = {"prompt_ids": torch.zeros(len(mask), 2, dtype=torch.long), "prompt_mask": torch.ones(len(mask), 2),
              "completion_ids": torch.zeros_like(mask), "completion_mask": mask, "advantages": b["adv"][rows],
              "ref_per_token_logps": b["ref"][rows], "num_items_in_batch": torch.tensor(float(num_items))}
    if with_old:
        inputs["old_per_token_logps"] = b["old"][rows]
    return _grpo_trainer()._compute_loss(trainer, None, inputs)


def _micro_batches(processes: int = P, accumulation: int = GA, rows: int = B) -> list[slice]:
    """The rows of each (process, micro-batch), process-major: TRL's layout of a step's global batch."""
    return [slice((p * accumulation + g) * rows, (p * accumulation + g + 1) * rows)
            for p in range(processes) for g in range(accumulation)]


CASES = [(loss_type, beta, eps_high, with_old)
         for loss_type in ("grpo", "dr_grpo", "dapo", "bnpo")
         for beta, eps_high, with_old in ((0.0, None, True), (0.04, 0.28, True), (0.1, None, False))]


@pytest.mark.parametrize(("loss_type", "beta", "epsilon_high", "with_old"), CASES)
def test_the_shares_of_a_step_add_up_to_trls_loss_and_gradients(loss_type, beta, epsilon_high, with_old):
    b = _batch(seed=len(loss_type) + int(100 * beta))
    tokens = float(b["mask"].sum())
    theirs_logps, ours_logps = b["logps"].clone().requires_grad_(True), b["logps"].clone().requires_grad_(True)
    trainer = _trl_self(loss_type, beta=beta, epsilon=0.2, epsilon_high=epsilon_high, processes=P, accumulation=GA,
                        steps_per_generation=GA)
    # DDP averages the processes' gradients: TRL's step loss is the mean over processes of their summed losses.
    theirs = sum(_trl_loss(trainer, theirs_logps, b, rows, num_items=tokens, with_old=with_old)
                 for rows in _micro_batches()) / P
    theirs.backward()

    ours = 0.0
    for rows in _micro_batches():
        terms = loss_terms(ours_logps[rows], b["old"][rows] if with_old else None, b["ref"][rows] if beta else None,
                           b["adv"][rows], epsilon=0.2, epsilon_high=epsilon_high, beta=beta)
        ours = ours + reduce(terms.per_token, b["mask"][rows], loss_type, completions_global=P * GA * B,
                             tokens_global=tokens, max_new_tokens=T)
    ours.backward()

    assert_close(ours.detach(), theirs.detach())
    assert_close(ours_logps.grad, theirs_logps.grad)
    assert theirs_logps.grad.abs().sum() > 0


def test_dapo_over_several_steps_per_generation_is_trls_with_the_rounds_tokens_per_step():
    """TRL's dapo normaliser is the generation round's tokens / steps: tokens_global = round tokens / 2 here."""
    b = _batch(seed=5, n=2 * P * GA * B)  # a round of two optimizer steps
    round_tokens = float(b["mask"].sum())
    step = {k: v[: P * GA * B] for k, v in b.items()}  # the first step of the round
    trainer = _trl_self("dapo", beta=0.0, epsilon=0.2, epsilon_high=None, processes=P, accumulation=GA,
                        steps_per_generation=2 * GA)
    theirs = sum(_trl_loss(trainer, step["logps"], step, rows, num_items=round_tokens, with_old=True)
                 for rows in _micro_batches()) / P
    ours = sum(reduce(loss_terms(step["logps"][rows], step["old"][rows], None, step["adv"][rows], epsilon=0.2,
                                 epsilon_high=None, beta=0.0).per_token,
                      step["mask"][rows], "dapo", completions_global=P * GA * B, tokens_global=round_tokens / 2,
                      max_new_tokens=T) for rows in _micro_batches())
    assert_close(ours, theirs)


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo"])
def test_any_split_of_the_batch_sums_to_the_whole_batch_loss(loss_type):
    """grpo, dr_grpo and dapo do not depend on how the rows are split over ranks and micro-batches (bnpo
    does: TRL normalises it per micro-batch)."""
    b = _batch(seed=11)
    n, tokens = len(b["mask"]), float(b["mask"].sum())

    def share(rows: slice) -> torch.Tensor:
        terms = loss_terms(b["logps"][rows], b["old"][rows], b["ref"][rows], b["adv"][rows], epsilon=0.2,
                           epsilon_high=0.3, beta=0.05)
        return reduce(terms.per_token, b["mask"][rows], loss_type, completions_global=n, tokens_global=tokens,
                      max_new_tokens=T)

    whole = share(slice(0, n))
    for cuts in ([0, 1, 5, 6, n], [0, 3, 4, 9, n]):  # uneven micro-batches on uneven ranks
        assert_close(sum(share(slice(a, z)) for a, z in zip(cuts, cuts[1:], strict=False)), whole)


@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_metrics_are_trls_token_weighted_means(beta):
    """One process, one micro-batch: TRL's logged kl and clip ratios equal metric_means of the summed metric_sums
    of any split of the batch."""
    b = _batch(seed=3, n=64)  # enough tokens in each clip region
    entropy = 2 * torch.rand(b["logps"].shape, generator=torch.Generator().manual_seed(4))
    trainer = _trl_self("dapo", beta=beta, epsilon=0.2, epsilon_high=0.4, processes=1, accumulation=1,
                        steps_per_generation=1)
    _trl_loss(trainer, b["logps"], b, slice(None), num_items=float(b["mask"].sum()), with_old=True, entropy=entropy)
    sums = sum(metric_sums(loss_terms(b["logps"][rows], b["old"][rows], b["ref"][rows] if beta else None,
                                      b["adv"][rows], epsilon=0.2, epsilon_high=0.4, beta=beta), b["mask"][rows],
                           entropy[rows])
               for rows in (slice(0, 5), slice(5, None)))
    ours = metric_means(sums, beta=beta)
    logged = trainer._metrics["train"]
    names = ["clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "entropy"] + (
        ["kl"] if beta else [])
    assert sorted(ours) == sorted(names)
    for name in names:
        assert ours[name] == pytest.approx(logged[name][0], rel=1e-5, abs=1e-7), name
    assert 0 < ours["clip_ratio/low_mean"] and 0 < ours["clip_ratio/high_mean"]


# ---- advantages -----------------------------------------------------------------------------------------------

def _trl_advantages(rewards: torch.Tensor, num_generations: int, scale: str) -> torch.Tensor:
    """TRL 1.16 _generate_and_score_completions, multi_objective_aggregation sum_then_normalize, on one reward
    function of weight 1, over the global batch (its lines, with its nanstd)."""
    nanstd = _nanstd()
    mean_grouped = torch.nanmean(rewards.view(-1, num_generations), dim=1).repeat_interleave(num_generations, dim=0)
    if scale in ("group", "none"):
        std = nanstd(rewards.view(-1, num_generations), dim=1).repeat_interleave(num_generations, dim=0)
    else:
        std = nanstd(rewards).expand_as(rewards)
    advantages = rewards - mean_grouped
    if scale != "none":
        advantages = advantages / (std + 1e-4)
    return torch.nan_to_num(advantages, nan=0.0)


def _rewards(seed: int, n: int = 24) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randint(0, 3, (n,), generator=g).float() + 0.1 * torch.randn(n, generator=g)
    rewards[:4] = 1.0  # a group whose rewards are all equal: std 0, advantages 0
    return rewards


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
@pytest.mark.parametrize("num_generations", [2, 4])
def test_advantages_are_trls(scale, num_generations):
    rewards = _rewards(seed=num_generations)
    ours = group_advantages(rewards, num_generations, scale)
    assert ours.dtype == torch.float32 and ours.shape == rewards.shape
    assert_close(ours, _trl_advantages(rewards, num_generations, scale))
    assert torch.equal(ours[:4], torch.zeros(4))


def test_the_batch_std_from_the_ranks_moments_is_trls_global_one():
    """Two ranks' halves: their summed moments give the std TRL takes over the gathered batch, and each rank's
    advantages are its slice of TRL's."""
    rewards = _rewards(seed=9)
    halves = rewards.chunk(2)
    std = batch_std(reward_moments(halves[0]) + reward_moments(halves[1]))
    assert_close(std, _nanstd()(rewards))
    trl = _trl_advantages(rewards, 4, "batch")
    for i, half in enumerate(halves):
        assert_close(group_advantages(half, 4, "batch", batch_std=std), trl.chunk(2)[i])
    assert batch_std(reward_moments(rewards[:1])) == 0


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="scale_rewards"):
        group_advantages(torch.zeros(4), 2, "rank")
    with pytest.raises(ValueError, match="multiple of num_generations"):
        group_advantages(torch.zeros(5), 2, "group")
    terms = loss_terms(torch.zeros(2, 3), None, None, torch.zeros(2), epsilon=0.2, epsilon_high=None, beta=0.0)
    with pytest.raises(ValueError, match="loss_type"):
        reduce(terms.per_token, torch.ones(2, 3), "ppo", completions_global=2, tokens_global=6, max_new_tokens=3)
    with pytest.raises(ValueError, match="reference"):
        loss_terms(torch.zeros(2, 3), None, None, torch.zeros(2), epsilon=0.2, epsilon_high=None, beta=0.1)


def test_truncated_importance_sampling_weights_each_token_and_measures_the_mismatch():
    """step.importance_sampling: each token's loss times min(pi_old / pi_sampler, cap) (TRL's token-level
    vllm_importance_sampling_correction, the ratio computed from the trainer's log-probabilities of the generating
    policy); the KL (k3) and the max ratio over the masked tokens only; cap None leaves the loss alone."""
    from fsdpjob.jobs.grpo.rounds import CompletionBatch
    from fsdpjob.jobs.grpo.step import importance_sampling

    g = torch.Generator().manual_seed(0)
    logps = -torch.rand(B, T, generator=g) * 3
    sampler = logps + torch.randn(B, T, generator=g) * 0.5
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[0, 4:] = False
    sampler[0, 5] = logps[0, 5] - 9.0  # a huge ratio outside the mask: neither weighted in nor counted
    terms = loss_terms(logps, None, None, torch.randn(B, generator=g), epsilon=0.2, epsilon_high=None, beta=0.0)
    batch = CompletionBatch([[1]] * B, torch.zeros(B, T, dtype=torch.long), mask, torch.zeros(B), None, sampler)
    weighted, stats = importance_sampling(terms, logps, batch, mask, 2.0)
    ratio = torch.exp(logps - sampler)
    assert_close(weighted.per_token, terms.per_token * ratio.clamp(max=2.0))
    kl = ((ratio - 1 - (logps - sampler)) * mask).sum()
    assert_close(stats, torch.stack([kl, mask.sum().float(), ratio[mask].max()]))
    old = logps - 0.1  # a later step of the round: the round's old log-probabilities, not this pass's
    batch.old_logps = old
    weighted, _ = importance_sampling(terms, logps, batch, mask, 2.0)
    assert_close(weighted.per_token, terms.per_token * torch.exp(old - sampler).clamp(max=2.0))
    unweighted, _ = importance_sampling(terms, logps, batch, mask, None)
    assert unweighted.per_token is terms.per_token


# ---- logged metrics: TRL 1.16's _generate_and_score_completions lines, with its nanstd ------------------------

def _trl_metrics(rewards_per_func, weights, names, completion_ids, lengths, num_generations, scale, end_ids):
    nanstd = _nanstd()
    rewards = (rewards_per_func * weights.unsqueeze(0)).nansum(dim=1)
    if scale == "batch":
        std_rewards = nanstd(rewards).expand_as(rewards)
    else:
        std_rewards = nanstd(rewards.view(-1, num_generations), dim=1).repeat_interleave(num_generations, dim=0)
    is_std_zero = torch.isclose(std_rewards, torch.zeros_like(std_rewards))
    out = {"reward": torch.nanmean(rewards).item(), "reward_std": nanstd(rewards).item(),
           "frac_reward_zero_std": is_std_zero.float().mean().item(),
           "completions/mean_length": lengths.float().mean().item(),
           "completions/min_length": lengths.float().min().item(),
           "completions/max_length": lengths.float().max().item(),
           "completions/clipped_ratio": torch.tensor([ids[:n][-1].item() not in end_ids for ids, n in
                                                      zip(completion_ids, lengths.tolist())]).float().mean().item()}
    for i, name in enumerate(names):
        out[f"rewards/{name}/mean"] = torch.nanmean(rewards_per_func[:, i]).item()
        out[f"rewards/{name}/std"] = nanstd(rewards_per_func[:, i]).item()
    return out


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_the_logged_reward_and_completion_metrics_are_trls(scale):
    """Two groups of 4, [0, 0, 1, 1 | 0, 0, 0, 0]: reward_std is the batch's (0.463), not the groups' mean (0.289);
    a function that said None for some completions has its mean and std over the others."""
    from fsdpjob.jobs.grpo.rounds import completion_metrics

    digits = torch.tensor([0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0])
    seen = torch.tensor([1.0, float("nan"), 0.0, 1.0, float("nan"), float("nan"), 0.0, 0.0])
    per_func, weights = torch.stack([digits, seen], dim=1), torch.tensor([1.0, 0.5])
    total = (per_func * weights).nansum(dim=1)
    eos, pad, width = 2, 0, 5
    lengths = torch.tensor([5, 3, 1, 5, 2, 4, 5, 5])
    ids = torch.randint(5, 50, (8, width), generator=torch.Generator().manual_seed(0))
    ids[1, 2], ids[2, 0], ids[4, 1], ids[5, 3], ids[6, 4] = eos, eos, eos, eos, eos  # 6 ends at max, with EOS
    mask = (torch.arange(width)[None, :] < lengths[:, None]).long()
    ours = completion_metrics(total, per_func.t(), ["digits", "seen"], ids, mask, num_generations=4,
                              scale_rewards=scale, end_ids=frozenset({eos, pad}))
    theirs = _trl_metrics(per_func, weights, ["digits", "seen"], ids, lengths, 4, scale, {eos, pad})
    assert ours.keys() == theirs.keys()
    for name in theirs:
        assert ours[name] == pytest.approx(theirs[name], rel=1e-6), name
    assert ours["completions/clipped_ratio"] == 3 / 8  # rows 0, 3, 7: cut at max_new_tokens without an end
    assert ours["frac_reward_zero_std"] == {"batch": 0.0}.get(scale, 0.5)  # the second group: all 0
    alone = completion_metrics(digits, digits.unsqueeze(0), ["digits"], ids, mask, num_generations=4,
                               scale_rewards=scale, end_ids=frozenset({eos, pad}))
    assert alone["reward_std"] == pytest.approx(0.4629, abs=1e-4)  # the batch's, not the groups' mean 0.2887
