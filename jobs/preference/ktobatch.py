"""KTO's mismatched rows: each answer's prompt with another answer's completion, for the batch's KL estimate.

TRL 1.16's KTOTrainer estimates the KL term from (prompt, completion) pairs that do not belong together: it
rotates the completions by one within each per-device batch of its sequentially read data, so example k's KL row
is (x_k, y_{k-1}). Here micro-batches are shuffled and the reference of every row may be cached before training,
so the mismatched completion must not depend on which rows share a micro-batch: each row's partner is fixed for
the table instead, by the same rotation applied to the whole table in an order drawn once from ``train.seed``
(``kl_partners``). The same table and seed give the same partners in every process, at any world size and after
any restart, so the cache (a second column: the mismatched row's reference log-probability) stays valid; the
partners enter the cache's key (``KtoTable.fingerprint``).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, fields

import torch

from ..data.examples import IGNORE
from ..data.pairtable import UnpairedBatch, UnpairedTable


def kl_partners(rows: int, seed: int) -> torch.Tensor:
    """[rows] long: the row whose completion each row's KL row takes. A seeded order of the table rotated by one
    (TRL's rotation, over the whole table): one cycle through every row, so no row is its own partner (one row
    is: with a single row there is nothing else). Its own generator stream: not the data stream's shuffle."""
    stream = int.from_bytes(hashlib.sha256(f"kto-kl:{seed}".encode()).digest()[:8], "little") >> 1
    order = torch.randperm(rows, generator=torch.Generator().manual_seed(stream))
    partners = torch.empty(rows, dtype=torch.long)
    partners[order] = order.roll(1)  # order[k] takes order[k - 1]'s completion: TRL's (x_k, y_{k-1})
    return partners


def prompt_lengths(labels: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """[N] each row's prompt length: its non-pad positions less its answer's (labels are IGNORE on the prompt
    and the padding, the answer's tokens elsewhere)."""
    return lengths - (labels != IGNORE).sum(dim=1)


def mismatched_rows(prompt_ids: torch.Tensor, prompt_len: torch.Tensor, answer_ids: torch.Tensor,
                    answer_labels: torch.Tensor, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Input ids and labels [B, L]: row b is the first ``prompt_len[b]`` tokens of ``prompt_ids[b]`` followed by
    the answer tokens of ``answer_ids[b]`` (where ``answer_labels[b]`` is not IGNORE), cut at L (TRL truncates
    the end too), right-padded with ``pad_id``; labels on the answer only, IGNORE elsewhere. Pure."""
    if prompt_ids.shape != answer_ids.shape or answer_ids.shape != answer_labels.shape:
        raise ValueError(f"rows of one shape expected, got {tuple(prompt_ids.shape)}, {tuple(answer_ids.shape)} "
                         f"and {tuple(answer_labels.shape)}")
    rows, width = prompt_ids.shape
    ids = torch.full((rows, width), pad_id, dtype=prompt_ids.dtype)
    labels = torch.full((rows, width), IGNORE, dtype=answer_labels.dtype)
    for row in range(rows):
        start = int(prompt_len[row])
        answer = answer_ids[row][answer_labels[row] != IGNORE][:max(width - start, 0)]
        end = start + answer.numel()
        ids[row, :start] = prompt_ids[row, :start]
        ids[row, start:end] = answer
        labels[row, start:end] = answer
    return ids, labels


@dataclass(frozen=True)
class KtoBatch(UnpairedBatch):
    """An unpaired micro-batch with each row's mismatched row: the answers then the KL rows go through one
    forward (batches.answer_rows), as a pair batch's chosen then rejected rows."""

    kl_ids: torch.Tensor  # [mbs, L]
    kl_labels: torch.Tensor


@dataclass(frozen=True)
class KtoTable(UnpairedTable):
    """kto's table: an UnpairedTable with each row's KL partner and the id padding is written with."""

    partners: torch.Tensor | None = None  # [N] long: kl_partners
    pad_id: int = 0

    @classmethod
    def of(cls, table: UnpairedTable, seed: int, pad_id: int) -> KtoTable:
        values = {f.name: getattr(table, f.name) for f in fields(table)}
        return cls(**values, partners=kl_partners(len(table), seed), pad_id=pad_id)

    def take(self, rows: torch.Tensor) -> KtoTable:
        # The partners point at rows of the whole table: a part of it would pair answers across the split.
        raise TypeError("take the rows of the UnpairedTable, then KtoTable.of each part: its partners are drawn "
                        "within it (data.eval_fraction never pairs a training answer with a held-out one)")

    def micro_batch(self, rows: torch.Tensor) -> KtoBatch:
        partners = self.partners[rows]
        kl_ids, kl_labels = mismatched_rows(self.ids[rows], prompt_lengths(self.labels[rows], self.lengths[rows]),
                                            self.ids[partners], self.labels[partners], self.pad_id)
        return KtoBatch(rows, self.ids[rows], self.labels[rows], self.desirable[rows], kl_ids, kl_labels)

    def row_lengths(self) -> torch.Tensor:
        """Non-pad positions of each row and of its KL row: the device computes both."""
        answers = (self.labels != IGNORE).sum(dim=1)
        kl = (prompt_lengths(self.labels, self.lengths) + answers[self.partners]).clamp(max=self.ids.shape[1])
        return self.lengths + kl

    def fingerprint(self) -> str:
        """The table's tokens and the partners: the cache's second column depends on both."""
        digest = hashlib.sha256(super().fingerprint().encode())
        digest.update(self.partners.contiguous().numpy().astype("<i8", copy=False).tobytes())
        return digest.hexdigest()
