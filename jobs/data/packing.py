"""Fixed-length sequences from examples: boundary-aware rows (best-fit decreasing, per-example positions), naive
concatenate-and-cut rows or one example per row; micro-batches and token counts."""

from __future__ import annotations

import bisect
import dataclasses
from dataclasses import dataclass
from itertools import chain
from typing import Literal, NamedTuple

import torch

from .examples import IGNORE, Example


@dataclass(frozen=True)
class SequenceTable:
    input_ids: torch.Tensor  # [N, L] long
    labels: torch.Tensor  # [N, L] long, IGNORE on padding and masked tokens
    num_examples: int
    truncated: int  # examples cut short to fit seq_len (packing true or false, long_examples truncate)
    # A mixture (data.sources): each row's source, and the sources' weights (mixture.py draws epochs from them).
    source: torch.Tensor | None = None  # [N] long
    weights: tuple[float, ...] | None = None
    # Boundary-aware packing: each position's place in its own example, restarting at 0 at every example (and
    # at the padding tail); the model reads example boundaries from these. None: positions 0..L-1 as today.
    position_ids: torch.Tensor | None = None  # [N, L] long
    lengths: torch.Tensor | None = None  # [N] long: each row's non-pad positions (rows are padded at the tail)
    split: int = 0  # examples cut into seq_len chunks (long_examples split)
    dropped: int = 0  # examples left out for being longer than seq_len (long_examples drop)

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def row_lengths(self) -> torch.Tensor:
        """Non-pad positions of each row ([N] long): what the device processes for real."""
        if self.lengths is not None:
            return self.lengths
        return torch.full((len(self),), self.input_ids.shape[1], dtype=torch.long)

    def attention_context(self) -> float:
        """The mean context a real token attends over, weighted as causal attention's work is: sum(L^2) / sum(L)
        over the sequences attention sees whole (each packed example with boundary-aware packing, each row's
        non-pad part otherwise). The MFU's attention term counts this, not seq_len: short packed examples do
        far less attention work than a full row."""
        lengths = self.row_lengths()
        if self.position_ids is not None:
            real = torch.arange(self.input_ids.shape[1]) < lengths[:, None]
            pos = self.position_ids
            # An example ends where the next position restarts at 0, or at the row's last real position.
            after = torch.cat([pos[:, 1:], torch.zeros_like(pos[:, :1])], dim=1)
            last = torch.cat([real[:, 1:], torch.zeros_like(real[:, :1])], dim=1).logical_not()
            ends = real & ((after == 0) | last)
            lengths = pos[ends] + 1
        total = float(lengths.sum())
        return float((lengths.double() ** 2).sum()) / total if total else 0.0

    @property
    def efficiency(self) -> float:
        """Packing efficiency: real tokens over row tokens."""
        return float(self.row_lengths().sum()) / max(self.input_ids.numel(), 1)


@dataclass(frozen=True)
class MicroBatch:
    input_ids: torch.Tensor  # [mbs, L]
    labels: torch.Tensor  # [mbs, L]
    sample_ids: torch.Tensor  # [mbs] global positions in the stream: unique over the whole run
    sequence_ids: torch.Tensor  # [mbs] rows of the SequenceTable
    position_ids: torch.Tensor | None = None  # [mbs, L] with boundary-aware packing: passed to the model


class StepBatch(NamedTuple):
    """One optimizer step's data on this rank."""

    micro_batches: list[MicroBatch]  # this rank's
    tokens: int  # real target tokens of the whole global batch (every rank's rows): the loss's denominator
    processed: int = 0  # non-pad positions of the whole global batch: what tokens/s and MFU count


# ---------------------------------------------------------------- sequences


PackingMode = Literal["boundary", "naive", "none"]
PACKING_SPEC = {"boundary": "true (boundary-aware)", "naive": "naive (concatenated and cut)",
                "none": "false (one example per row)"}  # each mode as data.packing spells it


def packing_mode(packing: bool | str) -> PackingMode:
    """data.packing as the mode a checkpoint records: true is boundary-aware, naive, false is one example a row."""
    if packing == "naive":
        return "naive"
    return "boundary" if packing else "none"


class _Pieces(NamedTuple):
    pieces: list[tuple[list[int], list[int]]]  # (input_ids, labels), each at most seq_len long
    truncated: int
    split: int
    dropped: int


def _fit(examples: list[Example], seq_len: int, long_examples: str) -> _Pieces:
    """Each example as pieces of at most ``seq_len`` tokens, by data.long_examples: truncate (its first
    seq_len tokens), split (seq_len chunks, each packed as an example of its own) or drop."""
    pieces, counts = [], {"truncate": 0, "split": 0, "drop": 0}
    for e in examples:
        n = len(e.input_ids)
        if n > seq_len:
            counts[long_examples] += 1
            if long_examples == "drop":
                continue
            if long_examples == "split":
                pieces += [(e.input_ids[i : i + seq_len], e.labels[i : i + seq_len]) for i in range(0, n, seq_len)]
                continue
        pieces.append((e.input_ids[:seq_len], e.labels[:seq_len]))
    if not pieces:
        raise ValueError(f"every example is longer than data.seq_len {seq_len} and data.long_examples is drop: "
                         "no data left; raise seq_len or use truncate or split")
    return _Pieces(pieces, counts["truncate"], counts["split"], counts["drop"])


def best_fit_rows(lengths: list[int], seq_len: int) -> list[list[int]]:
    """Best-fit decreasing: the indices of ``lengths`` (each <= seq_len) grouped into rows of at most seq_len.

    Longest first (ties in index order), each into the open row it leaves least room in, else a new row; each
    row keeps its examples in the order placed. Deterministic from the lengths alone, so every rank, start and
    world size builds the same table. Stays within a few percent of the optimum on spread-out lengths.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    rows: list[list[int]] = []
    room: list[tuple[int, int]] = []  # (free positions, row) of the open rows, sorted
    for i in order:
        at = bisect.bisect_left(room, (lengths[i], -1))
        if at < len(room):
            free, row = room.pop(at)
        else:
            free, row = seq_len, len(rows)
            rows.append([])
        rows[row].append(i)
        if free - lengths[i] > 0:
            bisect.insort(room, (free - lengths[i], row))
    return rows


def _boundary_table(fitted: _Pieces, num_examples: int, seq_len: int, pad_id: int) -> SequenceTable:
    pieces = [piece for piece in fitted.pieces if piece[0]]  # an empty example takes no place
    rows = best_fit_rows([len(ids) for ids, _ in pieces], seq_len)
    ids = torch.full((len(rows), seq_len), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), seq_len), IGNORE, dtype=torch.long)
    positions = torch.zeros((len(rows), seq_len), dtype=torch.long)
    lengths = torch.zeros(len(rows), dtype=torch.long)
    for r, members in enumerate(rows):
        at = 0
        for i in members:
            piece_ids, piece_labels = pieces[i]
            n = len(piece_ids)
            ids[r, at : at + n] = torch.tensor(piece_ids, dtype=torch.long)
            labels[r, at : at + n] = torch.tensor(piece_labels, dtype=torch.long)
            # Its first token would be predicted from the previous example's last: never a target.
            labels[r, at] = IGNORE
            positions[r, at : at + n] = torch.arange(n)
            at += n
        lengths[r] = at
        # The padding tail is a block of its own, so no real token attends to it (nor it to them).
        positions[r, at:] = torch.arange(seq_len - at)
    return SequenceTable(ids, labels, num_examples, fitted.truncated, position_ids=positions, lengths=lengths,
                         split=fitted.split, dropped=fitted.dropped)


def build_sequences(examples: list[Example], seq_len: int, packing: bool | str, pad_id: int,
                    long_examples: str = "truncate") -> SequenceTable:
    """Fixed-length rows by data.packing: true packs whole examples along their boundaries (best_fit_rows, each
    example's positions from 0), naive concatenates every example and cuts the stream at seq_len, false puts
    one example per row. Longer examples follow ``long_examples`` (not naive: it cuts anywhere)."""
    if not examples:
        raise ValueError("no examples to build sequences from")
    mode = packing_mode(packing)
    if mode == "naive":
        ids = torch.tensor(list(chain.from_iterable(e.input_ids for e in examples)), dtype=torch.long)
        labels = torch.tensor(list(chain.from_iterable(e.labels for e in examples)), dtype=torch.long)
        rows = -(-ids.numel() // seq_len)
        pad = rows * seq_len - ids.numel()  # the last row is padded rather than dropped: no data lost
        ids = torch.cat([ids, torch.full((pad,), pad_id, dtype=torch.long)]).view(rows, seq_len)
        labels = torch.cat([labels, torch.full((pad,), IGNORE, dtype=torch.long)]).view(rows, seq_len)
        lengths = torch.full((rows,), seq_len, dtype=torch.long)
        lengths[-1] = seq_len - pad
        return SequenceTable(ids, labels, len(examples), 0, lengths=lengths)
    fitted = _fit(examples, seq_len, long_examples)
    if mode == "boundary":
        return _boundary_table(fitted, len(examples), seq_len, pad_id)
    ids = torch.full((len(fitted.pieces), seq_len), pad_id, dtype=torch.long)
    labels = torch.full((len(fitted.pieces), seq_len), IGNORE, dtype=torch.long)
    lengths = torch.zeros(len(fitted.pieces), dtype=torch.long)
    for row, (piece_ids, piece_labels) in enumerate(fitted.pieces):
        n = lengths[row] = len(piece_ids)
        ids[row, :n] = torch.tensor(piece_ids, dtype=torch.long)
        labels[row, :n] = torch.tensor(piece_labels, dtype=torch.long)
    return SequenceTable(ids, labels, len(examples), fitted.truncated, lengths=lengths, split=fitted.split,
                         dropped=fitted.dropped)


def table_rows(table: SequenceTable, rows: torch.Tensor) -> SequenceTable:
    """The table's ``rows`` (in that order), with their sources and positions; the counts stay the table's."""
    def pick(t: torch.Tensor | None) -> torch.Tensor | None:
        return t[rows] if t is not None else None

    return dataclasses.replace(table, input_ids=table.input_ids[rows], labels=table.labels[rows],
                               source=pick(table.source), position_ids=pick(table.position_ids),
                               lengths=pick(table.lengths))


def micro_batch(table: SequenceTable, rows: torch.Tensor, sample_ids: torch.Tensor) -> MicroBatch:
    position_ids = table.position_ids[rows] if table.position_ids is not None else None
    return MicroBatch(table.input_ids[rows], table.labels[rows], sample_ids, rows, position_ids)


def count_tokens(labels: torch.Tensor) -> int:
    """Real target tokens in ``labels`` [B, L]: HF shifts labels left by one, so position 0 is never a target."""
    return int(row_tokens(labels).sum())


def row_tokens(labels: torch.Tensor) -> torch.Tensor:
    """Real target tokens of each row of ``labels`` [B, L] ([B] long)."""
    return (labels[:, 1:] != IGNORE).sum(dim=1)
