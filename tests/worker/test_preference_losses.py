"""The preference losses (jobs/preference/losses.py) against TRL 1.16's own code, called without a trainer.

TRL keeps DPO, KTO and the reward model's losses inside the trainers' loss methods, which read a handful of
attributes and call the model once or twice. These tests call those methods unbound, with a SimpleNamespace
``self`` that carries the configuration they read, and a stand-in model that returns the per-token
log-probabilities the fused LM head would: each row's summed log-probability at its first answer token and 0
elsewhere (TRL sums them, so it sees exactly the row sums given). ORPO's odds_ratio_loss and
get_batch_logps are plain methods. Value and gradient w.r.t. the policy's log-probabilities are compared per
row (TRL called on one row at a time) and as TRL's batch mean. Only cDPO (the "sigmoid" loss with
label_smoothing, which TRL 1.16 no longer implements) is checked against its formula written out here.
"""

from __future__ import annotations

import math
import warnings
from collections import defaultdict
from functools import partial
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from fsdpjob.jobs.data.examples import IGNORE
from fsdpjob.jobs.preference import (
    answer_logps,
    dpo_loss,
    kto_kl,
    kto_loss,
    orpo_loss,
    pair_metrics,
    reward_loss,
    rpo_term,
)

CPU = torch.device("cpu")
PROMPT = 3  # prompt tokens in front of every stand-in answer


def _trl(module: str, name: str):
    pytest.importorskip("trl")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # trl.experimental warns that it is experimental
        return getattr(__import__(module, fromlist=[name]), name)


def _self(**config) -> SimpleNamespace:
    """What TRL's loss methods read from the trainer, besides the loss's own configuration."""
    accelerator = SimpleNamespace(device=CPU, gather=lambda t: t, gather_for_metrics=lambda t: t)
    return SimpleNamespace(model=SimpleNamespace(training=True), accelerator=accelerator, aux_loss_enabled=False,
                           precompute_ref_logps=True, _metrics=defaultdict(lambda: defaultdict(list)),
                           _total_train_tokens=0, _tp_size=1, **config)


def _answers(tokens: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """completion_mask [N, width] with ``tokens[i]`` answer tokens after the prompt, and the one-hot [N, width - 1]
    of each row's first answer target in the shifted (per-token log-prob) frame."""
    mask = torch.zeros(len(tokens), width, dtype=torch.long)
    for i, n in enumerate(tokens.tolist()):
        mask[i, PROMPT:PROMPT + n] = 1
    first = torch.zeros(len(tokens), width - 1)
    first[:, PROMPT - 1] = 1.0
    return mask, first


def _outputs(log_probs: torch.Tensor) -> SimpleNamespace:
    zeros = torch.zeros_like(log_probs.detach())
    return SimpleNamespace(log_probs=log_probs, entropy=zeros, mean_logits=zeros, is_top1=zeros.bool())


def _leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone().requires_grad_(True)


def _pairs(seed: int, n: int = 6, dtype=torch.float32) -> dict[str, torch.Tensor]:
    """Seeded summed log-probs of n pairs (policy near the reference) and their answers' token counts."""
    g = torch.Generator().manual_seed(seed)
    chosen_tokens = torch.randint(1, 40, (n,), generator=g)
    rejected_tokens = torch.randint(1, 40, (n,), generator=g)
    rc = -chosen_tokens * (0.5 + torch.rand(n, generator=g))
    rr = -rejected_tokens * (0.5 + torch.rand(n, generator=g))
    pc = rc + 4 * torch.randn(n, generator=g)
    pr = rr + 4 * torch.randn(n, generator=g)
    return {"pc": pc.to(dtype), "pr": pr.to(dtype), "rc": rc.to(dtype), "rr": rr.to(dtype),
            "ct": chosen_tokens, "rt": rejected_tokens}


# ---- DPO ----------------------------------------------------------------------------------------------------

def _trl_dpo(pc, pr, rc, rr, ct, rt, *, beta, loss_types, loss_weights=None, label_smoothing=0.0):
    """TRL 1.16's DPOTrainer._compute_loss on the given summed log-probs; the batch-mean loss and ``self``."""
    dpo_trainer = _trl("trl.trainer.dpo_trainer", "DPOTrainer")
    width = PROMPT + int(torch.cat([ct, rt]).max()) + 2
    mask, first = _answers(torch.cat([ct, rt]), width)
    log_probs = first * torch.cat([pc, pr])[:, None]
    inputs = {"input_ids": torch.zeros_like(mask), "attention_mask": torch.ones_like(mask), "completion_mask": mask,
              "ref_chosen_logps": rc, "ref_rejected_logps": rr}
    trainer = _self(ld_alpha=None, f_divergence_type="reverse_kl", loss_types=loss_types, use_weighting=False,
                    loss_weights=loss_weights or [1.0] * len(loss_types), beta=beta, label_smoothing=label_smoothing)
    loss = dpo_trainer._compute_loss(trainer, lambda **_: _outputs(log_probs), inputs, return_outputs=False)
    return loss, trainer


DPO_CASES = [("sigmoid", 0.1, 0.0), ("hinge", 0.5, 0.0), ("ipo", 0.1, 0.0), ("ipo", 2.0, 0.0),
             ("robust", 0.1, 0.2), ("sigmoid_norm", 1.0, 0.0)]


@pytest.mark.parametrize(("loss_type", "beta", "smoothing"), DPO_CASES)
def test_dpo_loss_and_its_gradient_are_trls_row_by_row(loss_type, beta, smoothing):
    p = _pairs(seed=len(loss_type) + int(10 * beta))
    pc, pr = _leaf(p["pc"]), _leaf(p["pr"])
    ours = dpo_loss(pc, pr, p["rc"], p["rr"], beta=beta, loss_type=loss_type, label_smoothing=smoothing,
                    chosen_tokens=p["ct"], rejected_tokens=p["rt"])
    ours.losses.sum().backward()

    tc, tr = _leaf(p["pc"]), _leaf(p["pr"])
    rows = [_trl_dpo(tc[i:i + 1], tr[i:i + 1], p["rc"][i:i + 1], p["rr"][i:i + 1], p["ct"][i:i + 1],
                     p["rt"][i:i + 1], beta=beta, loss_types=[loss_type], label_smoothing=smoothing)[0]
            for i in range(len(tc))]
    theirs = torch.stack(rows)
    theirs.sum().backward()

    assert ours.losses.dtype == torch.float32 and ours.losses.shape == (len(tc),)
    assert_close(ours.losses.detach(), theirs.detach())
    assert_close(pc.grad, tc.grad)
    assert_close(pr.grad, tr.grad)
    if loss_type == "hinge":  # both sides of the kink are exercised
        assert (ours.losses == 0).any() and (ours.losses > 0).any()


@pytest.mark.parametrize(("loss_type", "beta", "smoothing"), DPO_CASES)
def test_dpo_batch_mean_and_metrics_are_trls(loss_type, beta, smoothing):
    p = _pairs(seed=7)
    ours = dpo_loss(p["pc"], p["pr"], p["rc"], p["rr"], beta=beta, loss_type=loss_type, label_smoothing=smoothing,
                    chosen_tokens=p["ct"], rejected_tokens=p["rt"])
    loss, trainer = _trl_dpo(p["pc"], p["pr"], p["rc"], p["rr"], p["ct"], p["rt"], beta=beta,
                             loss_types=[loss_type], label_smoothing=smoothing)
    assert_close(ours.losses.mean(), loss)
    metrics = pair_metrics(ours, p["pc"], p["pr"])
    logged = trainer._metrics["train"]
    for name, value in metrics.items():
        assert value.dim() == 0 and value.dtype == torch.float32 and not value.requires_grad
        assert_close(value, torch.tensor(logged[name][0]), msg=name)


def test_rpo_term_is_trls_sft_loss_type_weighted_by_alpha():
    """TRL 1.16's RPO: loss_type ["sigmoid", "sft"] with loss_weights [1, alpha]."""
    p, alpha = _pairs(seed=3), 0.7
    pc, pr = _leaf(p["pc"]), _leaf(p["pr"])
    ours = dpo_loss(pc, pr, p["rc"], p["rr"], beta=0.1, loss_type="sigmoid").losses.mean()
    ours = ours + alpha * rpo_term(pc, p["ct"]).mean()
    ours.backward()
    tc, tr = _leaf(p["pc"]), _leaf(p["pr"])
    theirs, _ = _trl_dpo(tc, tr, p["rc"], p["rr"], p["ct"], p["rt"], beta=0.1, loss_types=["sigmoid", "sft"],
                         loss_weights=[1.0, alpha])
    theirs.backward()
    assert_close(ours, theirs)
    assert_close(pc.grad, tc.grad)
    assert_close(pr.grad, tr.grad)
    assert rpo_term(pc, p["ct"]).shape == (len(pc),)


def test_cdpo_label_smoothing_is_the_conservative_dpo_formula():
    """TRL 1.16's "sigmoid" ignores label_smoothing, so cDPO (Mitchell 2023; TRL's "sigmoid" before its DPO
    rewrite) is checked against the formula: -(1 - e) logsigmoid(beta d) - e logsigmoid(-beta d)."""
    p, beta, e = _pairs(seed=11), 0.2, 0.15
    pc, pr = _leaf(p["pc"]), _leaf(p["pr"])
    ours = dpo_loss(pc, pr, p["rc"], p["rr"], beta=beta, loss_type="sigmoid", label_smoothing=e)
    ours.losses.sum().backward()
    tc, tr = _leaf(p["pc"]), _leaf(p["pr"])
    d = (tc - p["rc"]) - (tr - p["rr"])
    expected = -(1 - e) * F.logsigmoid(beta * d) - e * F.logsigmoid(-beta * d)
    expected.sum().backward()
    assert_close(ours.losses.detach(), expected.detach())
    assert_close(pc.grad, tc.grad)
    assert_close(pr.grad, tr.grad)


@pytest.mark.parametrize("beta", [0.1, 0.5, 3.0])
def test_dpo_sigmoid_is_ln2_with_zero_rewards_when_policy_is_the_reference(beta):
    p = _pairs(seed=5)
    out = dpo_loss(p["pc"], p["pr"], p["pc"].clone(), p["pr"].clone(), beta=beta, loss_type="sigmoid")
    assert_close(out.losses, torch.full_like(out.losses, math.log(2)), rtol=0, atol=0)
    assert torch.equal(out.chosen_rewards, torch.zeros(6)) and torch.equal(out.rejected_rewards, torch.zeros(6))
    assert pair_metrics(out, p["pc"], p["pr"])["rewards/accuracies"] == 0  # a tie is not a win, as in TRL


def test_dpo_rewards_are_beta_times_summed_logratios_and_detached():
    p = _pairs(seed=9)
    pc = _leaf(p["pc"])
    out = dpo_loss(pc, p["pr"], p["rc"], p["rr"], beta=0.3, loss_type="ipo", chosen_tokens=p["ct"],
                   rejected_tokens=p["rt"])
    assert not out.chosen_rewards.requires_grad and not out.rejected_rewards.requires_grad
    assert_close(out.chosen_rewards, 0.3 * (p["pc"] - p["rc"]))  # not divided by the token count, as TRL logs it
    assert_close(out.rejected_rewards, 0.3 * (p["pr"] - p["rr"]))


def test_dpo_refuses_what_it_cannot_compute():
    p = _pairs(seed=1)
    args = (p["pc"], p["pr"], p["rc"], p["rr"])
    for loss_type in ("ipo", "sigmoid_norm"):
        with pytest.raises(ValueError, match="chosen_tokens"):
            dpo_loss(*args, beta=0.1, loss_type=loss_type, rejected_tokens=p["rt"])
        with pytest.raises(ValueError, match="rejected_tokens"):
            dpo_loss(*args, beta=0.1, loss_type=loss_type, chosen_tokens=p["ct"])
    with pytest.raises(ValueError, match="loss_type"):
        dpo_loss(*args, beta=0.1, loss_type="exo_pair")
    with pytest.raises(ValueError, match="label_smoothing"):
        dpo_loss(*args, beta=0.1, loss_type="hinge", label_smoothing=0.1)
    with pytest.raises(ValueError, match="label_smoothing"):
        dpo_loss(*args, beta=0.1, loss_type="robust", label_smoothing=0.5)


# ---- ORPO ---------------------------------------------------------------------------------------------------

def test_orpo_is_trls_odds_ratio_loss():
    orpo_trainer = _trl("trl.experimental.orpo.orpo_trainer", "ORPOTrainer")
    g = torch.Generator().manual_seed(2)
    # Mean log-probs on both sides of TRL's log1mexp branch at -ln 2, and one close to 0.
    chosen = torch.cat([-3 * torch.rand(6, generator=g) - 1e-3, torch.tensor([-0.69, -1e-4])])
    rejected = torch.cat([-3 * torch.rand(6, generator=g) - 1e-3, torch.tensor([-0.70, -2.0])])
    beta = 0.25
    c, r = _leaf(chosen), _leaf(rejected)
    ours = orpo_loss(c, r, beta=beta)
    ours.losses.sum().backward()
    tc, tr = _leaf(chosen), _leaf(rejected)
    trainer = SimpleNamespace(beta=beta, accelerator=SimpleNamespace(device=CPU))
    losses, chosen_rewards, rejected_rewards, log_odds_ratio, log_odds_chosen = orpo_trainer.odds_ratio_loss(
        trainer, tc, tr)
    (-losses).sum().backward()  # TRL subtracts its term from the NLL: ours is its negative
    assert_close(ours.losses.detach(), -losses.detach())
    assert_close(c.grad, tc.grad)
    assert_close(r.grad, tr.grad)
    assert_close(ours.chosen_rewards, chosen_rewards)
    assert_close(ours.rejected_rewards, rejected_rewards)
    assert_close(ours.log_odds_ratio.mean(), log_odds_chosen)  # TRL's name for the mean log odds ratio
    assert_close(F.logsigmoid(ours.log_odds_ratio).mean(), log_odds_ratio)
    assert_close(pair_metrics(ours, c, r)["rewards/margins"], (chosen_rewards - rejected_rewards).mean())


# ---- KTO ----------------------------------------------------------------------------------------------------

def _trl_kto(policy, reference, desirable, kl_policy, kl_reference, *, beta, dw, uw):
    """TRL 1.16's KTOTrainer._compute_loss: its batch-mean loss and ``self``. The mismatched (KL) rows get a
    wider stand-in batch than the main one, so the stand-in model tells the two forwards apart."""
    kto_trainer = _trl("trl.trainer.kto_trainer", "KTOTrainer")
    n, width = len(policy), PROMPT + 4
    mask, first = _answers(torch.full((n,), 2), width)
    kl_mask, kl_first = _answers(torch.full((len(kl_policy),), 2), width + 1)
    batch = {"input_ids": torch.zeros_like(mask), "attention_mask": torch.ones_like(mask), "completion_mask": mask,
             "label": desirable, "ref_logps": reference, "ref_KL_logps": kl_reference,
             "KL_input_ids": torch.zeros_like(kl_mask), "KL_attention_mask": torch.ones_like(kl_mask),
             "KL_completion_mask": kl_mask}

    def model(*, input_ids, **_):
        if input_ids.size(1) == width + 1:
            return _outputs(kl_first * kl_policy[:, None])
        return _outputs(first * policy[:, None])

    trainer = _self(calculate_KL=True, loss_type="kto", beta=beta, desirable_weight=dw, undesirable_weight=uw)
    trainer._compute_kl_logps = partial(kto_trainer._compute_kl_logps, trainer)
    return kto_trainer._compute_loss(trainer, model, batch, return_outputs=False), trainer


@pytest.mark.parametrize("kl_shift", [0.8, -0.8])  # a positive KL estimate, and a negative one clamped at 0
def test_kto_loss_kl_and_rewards_are_trls(kl_shift):
    g = torch.Generator().manual_seed(4)
    n, beta, dw, uw = 7, 0.4, 1.3, 0.6
    reference = -20 * torch.rand(n, generator=g) - 1
    policy = reference + 3 * torch.randn(n, generator=g)
    desirable = torch.tensor([True, False, True, True, False, False, True])
    kl_reference = -20 * torch.rand(5, generator=g) - 1
    kl_policy = kl_reference + kl_shift + 0.1 * torch.randn(5, generator=g)

    kl = kto_kl(kl_policy, kl_reference)
    assert kl.dim() == 0 and kl.dtype == torch.float32 and not kl.requires_grad
    p = _leaf(policy)
    ours = kto_loss(p, reference, desirable, kl, beta=beta, desirable_weight=dw, undesirable_weight=uw)
    ours.losses.sum().backward()

    t = _leaf(policy)
    rows = [_trl_kto(t[i:i + 1], reference[i:i + 1], desirable[i:i + 1], kl_policy, kl_reference,
                     beta=beta, dw=dw, uw=uw)[0] for i in range(n)]
    theirs = torch.stack(rows)
    theirs.sum().backward()
    assert_close(ours.losses.detach(), theirs.detach())
    assert_close(p.grad, t.grad)

    loss, trainer = _trl_kto(policy, reference, desirable, kl_policy, kl_reference, beta=beta, dw=dw, uw=uw)
    logged = trainer._metrics["train"]
    assert_close(ours.losses.mean(), loss)
    assert_close(kl.clamp(min=0), torch.tensor(logged["kl"][0]))
    assert (kl < 0) == (kl_shift < 0)  # kto_kl leaves the clamp to kto_loss, after the caller's all-reduce
    assert_close(ours.rewards[desirable].mean(), torch.tensor(logged["rewards/chosen"][0]))
    assert_close(ours.rewards[~desirable].mean(), torch.tensor(logged["rewards/rejected"][0]))


# ---- reward model -------------------------------------------------------------------------------------------

def _trl_reward(chosen, rejected, margin):
    reward_trainer = _trl("trl.trainer.reward_trainer", "RewardTrainer")
    n = len(chosen)
    inputs = {"input_ids": torch.zeros(2 * n, 5, dtype=torch.long), "attention_mask": torch.ones(2 * n, 5)}
    if margin is not None:
        inputs["margin"] = margin
    scores = torch.cat([chosen, rejected])[:, None]
    trainer = _self(args=SimpleNamespace(center_rewards_coefficient=None))
    return reward_trainer.compute_loss(trainer, lambda **_: SimpleNamespace(logits=scores), inputs)


@pytest.mark.parametrize("with_margin", [False, True])
def test_reward_loss_is_trls(with_margin):
    g = torch.Generator().manual_seed(6)
    chosen, rejected = 2 * torch.randn(5, generator=g), 2 * torch.randn(5, generator=g)
    margin = torch.rand(5, generator=g) if with_margin else None
    c, r = _leaf(chosen), _leaf(rejected)
    ours = reward_loss(c, r, margin)
    ours.sum().backward()
    tc, tr = _leaf(chosen), _leaf(rejected)
    rows = [_trl_reward(tc[i:i + 1], tr[i:i + 1], None if margin is None else margin[i:i + 1]) for i in range(5)]
    theirs = torch.stack(rows)
    theirs.sum().backward()
    assert_close(ours.detach(), theirs.detach())
    assert_close(c.grad, tc.grad)
    assert_close(r.grad, tr.grad)
    assert_close(ours.mean(), _trl_reward(chosen, rejected, margin))


# ---- answer_logps -------------------------------------------------------------------------------------------

def _lse(row: list[float]) -> float:
    return math.log(sum(math.exp(v) for v in row))


def test_answer_logps_by_hand_with_the_projects_shift():
    logits = torch.tensor([[[0.0, 1.0, 3.0], [2.0, 0.5, 1.0], [1.0, 2.0, 0.0], [0.3, 0.2, 0.1]],
                           [[1.0, 0.0, 0.0], [0.0, 2.0, 1.0], [3.0, 1.0, 2.0], [0.0, 0.0, 4.0]]])
    labels = torch.tensor([[IGNORE, 1, 2, IGNORE],  # targets at positions 0 and 1
                           [IGNORE, 2, IGNORE, 0]])  # targets at positions 0 and 2, an IGNORE between
    sums, counts = answer_logps(logits, labels)
    lg = logits.tolist()
    row0 = (lg[0][0][1] - _lse(lg[0][0])) + (lg[0][1][2] - _lse(lg[0][1]))
    row1 = (lg[1][0][2] - _lse(lg[1][0])) + (lg[1][2][0] - _lse(lg[1][2]))
    assert_close(sums, torch.tensor([row0, row1]))
    assert counts.tolist() == [2, 2]
    # Reading position t's logits for labels[:, t] (no shift) gives other numbers.
    unshifted = (lg[0][1][1] - _lse(lg[0][1])) + (lg[0][2][2] - _lse(lg[0][2]))
    assert abs(unshifted - row0) > 0.5
    # The IGNORE positions' logits do not matter, and get no gradient.
    leaf = _leaf(logits)
    answer_logps(leaf, labels)[0].sum().backward()
    assert torch.all(leaf.grad[0, 2:] == 0) and torch.all(leaf.grad[1, 1] == 0) and torch.all(leaf.grad[1, 3] == 0)
    changed = logits.clone()
    changed[0, 2:] += 5.0
    changed[1, 1] -= 7.0
    assert_close(answer_logps(changed, labels)[0], sums)


def test_answer_logps_and_its_gradient_are_trls_batch_logps():
    orpo_trainer = _trl("trl.experimental.orpo.orpo_trainer", "ORPOTrainer")
    g = torch.Generator().manual_seed(8)
    logits = 3 * torch.randn(4, 9, 11, generator=g)
    labels = torch.randint(0, 11, (4, 9), generator=g)
    labels[torch.rand(4, 9, generator=g) < 0.4] = IGNORE
    labels[3] = IGNORE  # a row without targets: 0 and 0
    ours_logits, their_logits = _leaf(logits), _leaf(logits)
    sums, counts = answer_logps(ours_logits, labels)
    theirs = orpo_trainer.get_batch_logps(their_logits, labels, average_log_prob=False)
    (sums * torch.arange(1.0, 5.0)).sum().backward()
    (theirs * torch.arange(1.0, 5.0)).sum().backward()
    assert_close(sums, theirs)
    assert_close(ours_logits.grad, their_logits.grad)
    assert counts.tolist() == (labels[:, 1:] != IGNORE).sum(1).tolist() and counts[3] == 0 and sums[3] == 0


def test_bf16_inputs_give_fp32_results():
    g = torch.Generator().manual_seed(10)
    logits = torch.randn(2, 6, 13, generator=g).bfloat16().requires_grad_(True)
    labels = torch.randint(0, 13, (2, 6), generator=g)
    labels[:, :2] = IGNORE
    sums, counts = answer_logps(logits, labels)
    assert sums.dtype == torch.float32
    assert_close(sums, answer_logps(logits.detach().float(), labels)[0], rtol=0, atol=0)  # fp32 math on bf16 values
    sums.sum().backward()
    assert logits.grad is not None and logits.grad.dtype == torch.bfloat16

    p = _pairs(seed=12, dtype=torch.bfloat16)
    tokens = {"chosen_tokens": p["ct"], "rejected_tokens": p["rt"]}
    for loss_type in ("sigmoid", "ipo", "hinge", "robust", "sigmoid_norm"):
        out = dpo_loss(p["pc"], p["pr"], p["rc"], p["rr"], beta=0.1, loss_type=loss_type, **tokens)
        assert all(t.dtype == torch.float32 for t in out), loss_type
    assert all(t.dtype == torch.float32 for t in orpo_loss(p["pc"] / 50, p["pr"] / 50, beta=0.1))
    kto = kto_loss(p["pc"], p["rc"], p["ct"] > 20, kto_kl(p["pr"], p["rr"]), beta=0.1, desirable_weight=1.0,
                   undesirable_weight=1.0)
    assert all(t.dtype == torch.float32 for t in kto)
    assert reward_loss(p["pc"], p["pr"], p["rc"]).dtype == torch.float32
    assert rpo_term(p["pc"], p["ct"]).dtype == torch.float32
    metrics = pair_metrics(dpo_loss(p["pc"], p["pr"], p["rc"], p["rr"], beta=0.1, loss_type="sigmoid"), p["pc"],
                           p["pr"])
    assert all(v.dtype == torch.float32 for v in metrics.values())
