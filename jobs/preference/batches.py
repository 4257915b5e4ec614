"""A preference micro-batch as the model sees it: both answers of every pair in one forward (chosen rows, then
rejected rows, as TRL's concatenated forward), or kto's answers then their mismatched KL rows (ktobatch.py), and
their summed answer log-probabilities."""

from __future__ import annotations

import torch

from fsdpjob.jobs.data.examples import IGNORE

from .losses import answer_logps


def answer_rows(batch) -> tuple[torch.Tensor, torch.Tensor]:
    """Input ids and labels [R, L] of a micro-batch: a pair batch's chosen rows then its rejected rows (R = 2B),
    kto's answers then their KL rows (R = 2B), an unpaired batch without KL rows as it is."""
    if hasattr(batch, "chosen_ids"):
        return (torch.cat([batch.chosen_ids, batch.rejected_ids]), torch.cat([batch.chosen_labels,
                                                                               batch.rejected_labels]))
    if hasattr(batch, "kl_ids"):
        return torch.cat([batch.ids, batch.kl_ids]), torch.cat([batch.labels, batch.kl_labels])
    return batch.ids, batch.labels


def policy_logps(model: torch.nn.Module, batch, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The policy's answer log-probabilities and token counts of answer_rows(batch), [R] each. kto's KL rows go
    through a second forward without autograd (TRL's too): they enter only the detached KL estimate, so keeping
    their activations for a backward would double the step's memory for nothing."""
    if not hasattr(batch, "kl_ids"):
        return concatenated_logps(model, *answer_rows(batch), device)
    logps, counts = concatenated_logps(model, batch.ids, batch.labels, device)
    with torch.no_grad():
        kl_logps, kl_counts = concatenated_logps(model, batch.kl_ids, batch.kl_labels, device)
    return torch.cat([logps, kl_logps]), torch.cat([counts, kl_counts])


def orpo_logps(model: torch.nn.Module, batch, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """ORPO's forward (one, over the chosen then the rejected rows): per row [R, 2] the answer's summed
    log-probability and, for the chosen rows, the whole row's (prompt and answer: every non-pad token after the
    first, as TRL's NLL takes it; 0 on the rejected rows), with their token counts [R, 2]."""
    ids, labels = answer_rows(batch)
    logits = model(input_ids=ids.to(device), use_cache=False).logits
    answers, answer_counts = answer_logps(logits, labels.to(device))
    chosen = batch.chosen_ids.shape[0]
    positions = torch.arange(ids.shape[1]).unsqueeze(0)
    whole = torch.where(positions < batch.chosen_lengths.unsqueeze(1), batch.chosen_ids, IGNORE).to(device)
    rows, row_counts = answer_logps(logits[:chosen], whole)
    pad = torch.zeros(ids.shape[0] - chosen, dtype=rows.dtype, device=rows.device)
    return (torch.stack([answers, torch.cat([rows, pad])], dim=1),
            torch.stack([answer_counts, torch.cat([row_counts, pad.long()])], dim=1))


def concatenated_logps(model: torch.nn.Module, ids: torch.Tensor, labels: torch.Tensor,
                       device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: the answer's summed log-probability under ``model`` and its token count. Rows are right-padded
    and the model is causal, so an answer attends to its prompt and itself only: no attention mask needed."""
    logits = model(input_ids=ids.to(device), use_cache=False).logits
    return answer_logps(logits, labels.to(device))


def reward_scores(model: torch.nn.Module, batch, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of answer_rows(batch): a reward model's score (the sequence classifier's own pooling: its head at
    the row's last token that is not the pad id, jobs/model/scorehead.py) and the answer's token count."""
    ids, labels = answer_rows(batch)
    scores = model(input_ids=ids.to(device), use_cache=False).logits.squeeze(-1)
    return scores, (labels[:, 1:] != IGNORE).sum(dim=1).to(device)
