"""Tables of preference data: one row per answer (prompt + answer), right-padded to seq_len, labels IGNORE on the
prompt and the padding and the answer's own tokens elsewhere (aligned with input_ids: jobs/step.py shifts them).

A PairTable holds a pair's chosen and rejected rows side by side (row i of each is pair i), so a micro-batch of
pairs carries both answers; an UnpairedTable holds kto's labelled answers. Both answer BatchStream's questions
(``len``, ``source``, ``weights``, ``row_tokens``, ``row_lengths``) and give a fingerprint of their token ids,
which keys the reference model's cached log-probabilities: the same table gives the same fingerprint in any
process, and any change to a token id, a label or the row count changes it.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .examples import IGNORE


def pad_id_of(tokenizer: Any) -> int:
    """The id padding is written with: the tokenizer's pad token, else eos, else 0 (never a target either way)."""
    for token_id in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if token_id is not None:
            return int(token_id)
    return 0


def _targets(labels: torch.Tensor) -> torch.Tensor:
    """Target tokens of each row of ``labels`` [N, L] after the shift: position 0 is never a target
    (packing.row_tokens' count)."""
    return (labels[:, 1:] != IGNORE).sum(dim=1)


def tensors_fingerprint(tensors: Sequence[torch.Tensor]) -> str:
    digest = hashlib.sha256()
    for t in tensors:
        # The shape and dtype first: two tables with the same bytes in other shapes differ. Little-endian int64
        # bytes whatever the machine, so every process and host agrees.
        digest.update(f"{tuple(t.shape)}:{t.dtype};".encode())
        digest.update(t.detach().cpu().contiguous().numpy().astype("<i8", copy=False).tobytes())
    return digest.hexdigest()


def _rows(sequences: list[tuple[list[int], list[int]]], seq_len: int,
          pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids, labels, lengths) of (prompt, answer) sequences, one row each, right-padded to seq_len."""
    ids = torch.full((len(sequences), seq_len), pad_id, dtype=torch.long)
    labels = torch.full((len(sequences), seq_len), IGNORE, dtype=torch.long)
    lengths = torch.zeros(len(sequences), dtype=torch.long)
    for row, (prompt, answer) in enumerate(sequences):
        n, start = len(prompt) + len(answer), len(prompt)
        if n > seq_len:
            raise ValueError(f"a sequence of {n} tokens does not fit seq_len {seq_len}: read the data with "
                             "jobs.data.preference (it applies data.long_examples)")
        ids[row, :n] = torch.tensor(prompt + answer, dtype=torch.long)
        labels[row, start:n] = ids[row, start:n]
        lengths[row] = n
    return ids, labels, lengths


def _take(table: Any, rows: torch.Tensor) -> Any:
    """``table`` with only ``rows`` (in that order): every per-row tensor indexed, the counts of what was read
    kept (they describe the file, not the split)."""
    n = len(table)
    per_row = {f.name: getattr(table, f.name)[rows] for f in dataclasses.fields(table)
               if isinstance(getattr(table, f.name), torch.Tensor) and getattr(table, f.name).shape[:1] == (n,)}
    return dataclasses.replace(table, **per_row)


def mixture_table(tables: Sequence[Any], weights: Sequence[float]) -> Any:
    """One table of a mixture's sources (each read on its own, in data.sources' order): their rows one after the
    other, each row's source, the weights, and the counts of what was read summed."""
    if not tables or len(tables) != len(weights):
        raise ValueError(f"{len(tables)} tables for {len(weights)} weights: one table per source")
    first = tables[0]
    per_row = {f.name: torch.cat([getattr(t, f.name) for t in tables]) for f in dataclasses.fields(first)
               if isinstance(getattr(first, f.name), torch.Tensor) and f.name != "source"}
    counts = {name: sum(getattr(t, name) for t in tables) for name in ("num_examples", "truncated", "dropped")}
    source = torch.cat([torch.full((len(t),), i, dtype=torch.long) for i, t in enumerate(tables)])
    return dataclasses.replace(first, **per_row, **counts, source=source, weights=tuple(weights))


# ---------------------------------------------------------------- pairs


@dataclass(frozen=True)
class PairBatch:
    rows: torch.Tensor  # [mbs] the pairs' rows in the table (the reference log-prob cache is keyed by them)
    chosen_ids: torch.Tensor  # [mbs, L]
    chosen_labels: torch.Tensor
    rejected_ids: torch.Tensor
    rejected_labels: torch.Tensor
    margins: torch.Tensor | None  # [mbs] float, reward.margin_field's
    chosen_lengths: torch.Tensor | None = None  # [mbs] long: the chosen rows' non-pad positions (ORPO's NLL)

    # A pair is one sample: the samples log (FSDPJOB_LOG_SAMPLES, jobs/hooks.py) names it by its row.
    sample_ids = property(lambda self: self.rows)
    sequence_ids = sample_ids


@dataclass(frozen=True)
class PairTable:
    chosen_ids: torch.Tensor  # [N, L] long
    chosen_labels: torch.Tensor  # [N, L] long, IGNORE on the prompt and the padding
    rejected_ids: torch.Tensor
    rejected_labels: torch.Tensor
    margins: torch.Tensor | None  # [N] float
    lines: torch.Tensor  # [N] long: each pair's line (row) in its file
    lengths: torch.Tensor  # [N, 2] long: non-pad positions of the chosen and the rejected row
    num_examples: int = 0  # records read (dropped ones included)
    truncated: int = 0  # pairs with an answer cut at its end (long_examples truncate)
    dropped: int = 0  # pairs left out (long_examples drop)
    # A mixture's (data.sources): each row's source index [N] long, and the sources' weights; BatchStream draws
    # each epoch's rows by them (mixture.py). None: one source.
    source: torch.Tensor | None = None
    weights: tuple[float, ...] | None = None
    split = 0  # never split (the spec refuses it); SequenceTable's count, for the data event

    def __len__(self) -> int:
        return self.chosen_ids.shape[0]

    def take(self, rows: torch.Tensor) -> PairTable:
        """The pairs at ``rows``, both answers of each (data.eval_fraction's split)."""
        return _take(self, rows)

    def micro_batch(self, rows: torch.Tensor) -> PairBatch:
        margins = self.margins[rows] if self.margins is not None else None
        return PairBatch(rows, self.chosen_ids[rows], self.chosen_labels[rows], self.rejected_ids[rows],
                         self.rejected_labels[rows], margins, self.lengths[rows, 0])

    def row_tokens(self) -> torch.Tensor:
        """Target tokens of each pair, both answers ([N] long)."""
        return _targets(self.chosen_labels) + _targets(self.rejected_labels)

    def row_lengths(self) -> torch.Tensor:
        """Non-pad positions of each pair's two rows ([N] long): what the device processes for real."""
        return self.lengths.sum(dim=1)

    def fingerprint(self) -> str:
        """sha256 of the token ids and labels of both answers (what the reference's log-probabilities depend on;
        the margins do not enter them)."""
        return tensors_fingerprint([self.chosen_ids, self.chosen_labels, self.rejected_ids, self.rejected_labels])


def build_pair_table(pairs: Sequence[Any], seq_len: int, pad_id: int) -> PairTable:
    """The table of ``pairs`` (preference.Pair, within seq_len); a preference.Fitted list brings its counts."""
    if not pairs:
        raise ValueError("no pairs to build a table from")
    chosen_ids, chosen_labels, chosen_len = _rows([(p.prompt_ids, p.chosen_ids) for p in pairs], seq_len, pad_id)
    rejected_ids, rejected_labels, rejected_len = _rows([(p.prompt_ids, p.rejected_ids) for p in pairs], seq_len,
                                                        pad_id)
    given = [p.margin is not None for p in pairs]
    if any(given) and not all(given):
        raise ValueError("some pairs have a margin and some not: give every pair one, or none")
    margins = torch.tensor([p.margin for p in pairs], dtype=torch.float32) if all(given) else None
    lines = torch.tensor([p.line for p in pairs], dtype=torch.long)
    return PairTable(chosen_ids, chosen_labels, rejected_ids, rejected_labels, margins, lines,
                     torch.stack([chosen_len, rejected_len], 1),
                     getattr(pairs, "read", len(pairs)), getattr(pairs, "truncated", 0), getattr(pairs, "dropped", 0))


# ---------------------------------------------------------------- kto's labelled answers


@dataclass(frozen=True)
class UnpairedBatch:
    rows: torch.Tensor  # [mbs] the answers' rows in the table
    ids: torch.Tensor  # [mbs, L]
    labels: torch.Tensor
    desirable: torch.Tensor  # [mbs] bool

    sample_ids = property(lambda self: self.rows)  # as a pair's (PairBatch)
    sequence_ids = sample_ids


@dataclass(frozen=True)
class UnpairedTable:
    ids: torch.Tensor  # [N, L] long
    labels: torch.Tensor  # [N, L] long, IGNORE on the prompt and the padding
    desirable: torch.Tensor  # [N] bool
    lines: torch.Tensor  # [N] long
    lengths: torch.Tensor  # [N] long: non-pad positions
    num_examples: int = 0
    truncated: int = 0
    dropped: int = 0
    source: torch.Tensor | None = None  # as a PairTable's
    weights: tuple[float, ...] | None = None
    split = 0

    def __len__(self) -> int:
        return self.ids.shape[0]

    def take(self, rows: torch.Tensor) -> UnpairedTable:
        """The answers at ``rows`` (kto's KL partners are drawn after the split, within each side: ktobatch.py)."""
        return _take(self, rows)

    def micro_batch(self, rows: torch.Tensor) -> UnpairedBatch:
        return UnpairedBatch(rows, self.ids[rows], self.labels[rows], self.desirable[rows])

    def row_tokens(self) -> torch.Tensor:
        return _targets(self.labels)

    def row_lengths(self) -> torch.Tensor:
        return self.lengths

    def fingerprint(self) -> str:
        """sha256 of the token ids and labels (the reference's log-probabilities depend on nothing else)."""
        return tensors_fingerprint([self.ids, self.labels])


def build_unpaired_table(answers: Sequence[Any], seq_len: int, pad_id: int) -> UnpairedTable:
    """The table of ``answers`` (preference.Unpaired, within seq_len); a preference.Fitted list brings its counts."""
    if not answers:
        raise ValueError("no answers to build a table from")
    ids, labels, lengths = _rows([(a.prompt_ids, a.completion_ids) for a in answers], seq_len, pad_id)
    return UnpairedTable(ids, labels, torch.tensor([a.desirable for a in answers], dtype=torch.bool),
                         torch.tensor([a.line for a in answers], dtype=torch.long), lengths,
                         getattr(answers, "read", len(answers)), getattr(answers, "truncated", 0),
                         getattr(answers, "dropped", 0))
