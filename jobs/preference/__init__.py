"""The preference methods (train.method dpo | orpo | kto | reward): their losses on per-answer log-probabilities
(losses)."""

from .losses import (
    DPO_LOSS_TYPES,
    KtoLoss,
    OrpoLoss,
    PairLoss,
    answer_logps,
    dpo_loss,
    kto_kl,
    kto_loss,
    orpo_loss,
    pair_metrics,
    reward_loss,
    rpo_term,
)

__all__ = [
    "DPO_LOSS_TYPES", "KtoLoss", "OrpoLoss", "PairLoss", "answer_logps", "dpo_loss", "kto_kl", "kto_loss",
    "orpo_loss", "pair_metrics", "reward_loss", "rpo_term",
]
