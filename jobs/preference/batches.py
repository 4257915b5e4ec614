"""A preference micro-batch as the model sees it: both answers of every pair in one forward (chosen rows, then
rejected rows, as TRL's concatenated forward), and their summed answer log-probabilities."""

from __future__ import annotations

import torch

from .losses import answer_logps


def answer_rows(batch) -> tuple[torch.Tensor, torch.Tensor]:
    """Input ids and labels [R, L] of a micro-batch: a pair batch's chosen rows then its rejected rows (R = 2B),
    an unpaired batch's rows as they are."""
    if hasattr(batch, "chosen_ids"):
        return (torch.cat([batch.chosen_ids, batch.rejected_ids]), torch.cat([batch.chosen_labels,
                                                                               batch.rejected_labels]))
    return batch.ids, batch.labels


def concatenated_logps(model: torch.nn.Module, ids: torch.Tensor, labels: torch.Tensor,
                       device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: the answer's summed log-probability under ``model`` and its token count. Rows are right-padded
    and the model is causal, so an answer attends to its prompt and itself only: no attention mask needed."""
    logits = model(input_ids=ids.to(device), use_cache=False).logits
    return answer_logps(logits, labels.to(device))
