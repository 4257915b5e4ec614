"""The resumable batch stream over a packed table (epochs, shuffling, resharding to any world size) and the eval
split and batches."""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any, NamedTuple

import torch

from .examples import IGNORE
from .mixture import epoch_rows, epoch_size
from .packing import (
    PACKING_SPEC,
    MicroBatch,
    PackingMode,
    SequenceTable,
    StepBatch,
    micro_batch,
    row_tokens,
    table_rows,
)

# ---------------------------------------------------------------- batch stream


def _epoch_seed(seed: int, epoch: int) -> int:
    digest = hashlib.sha256(f"fsdpjob-data:{seed}:{epoch}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


class BatchStream:
    """Deterministic, resumable, reshardable micro-batches over a SequenceTable.

    The global order runs epoch after epoch, each a permutation of the N rows drawn from (seed,
    epoch). Position p of the stream is row perm_{p // N}[p % N]. A step takes the next G =
    micro_batch_size * grad_accum_steps * dp_world positions; rank r takes the r-th contiguous block
    of them. Only the position counter is state, so a resume with any dp_world (and even another G)
    continues at the exact next sample. A mixture's epoch (table.source set) is the sources' weighted
    shares instead of a permutation of the rows; mixture.py makes it from (seed, epoch) alone.
    """

    def __init__(
        self,
        table: SequenceTable,
        *,
        seed: int,
        shuffle: bool,
        micro_batch_size: int,
        grad_accum_steps: int,
        dp_rank: int,
        dp_world: int,
        packing: PackingMode = "boundary",
    ):
        if not 0 <= dp_rank < dp_world:
            raise ValueError(f"dp_rank {dp_rank} is not in [0, {dp_world})")
        if micro_batch_size < 1 or grad_accum_steps < 1:
            raise ValueError("micro_batch_size and grad_accum_steps must be at least 1")
        self.table = table
        self.seed = seed
        self.shuffle = shuffle
        self.micro_batch_size = micro_batch_size
        self.grad_accum_steps = grad_accum_steps
        self.dp_rank = dp_rank
        self.dp_world = dp_world
        self.packing = packing  # recorded in the checkpoint: a resume must pack the way the run started
        self.samples_consumed = 0
        self._perms: dict[int, torch.Tensor] = {}
        # Rows an epoch takes: the table's, or with a mixture the sources' shares of it (mixture.py).
        self.epoch_size = len(table) if table.source is None else epoch_size(table.source, table.weights)
        # Every rank holds the whole table, so each counts the global batch's target tokens itself (the loss's
        # denominator) instead of summing the ranks' counts in a collective every step.
        self._row_tokens = row_tokens(table.labels) if isinstance(table, SequenceTable) else table.row_tokens()
        self._row_lengths = table.row_lengths()
        # A preference table (data/preference.py: a pair or an answer per row) makes its own micro-batches.
        self._micro_batch = ((lambda rows, positions: micro_batch(table, rows, positions))
                             if isinstance(table, SequenceTable)
                             else (lambda rows, _positions: table.micro_batch(rows)))

    @property
    def global_batch_size(self) -> int:
        return self.micro_batch_size * self.grad_accum_steps * self.dp_world

    @property
    def epoch(self) -> float:
        """Passes over the data so far (fractional)."""
        return self.samples_consumed / self.epoch_size

    def _perm(self, epoch: int) -> torch.Tensor:
        if epoch not in self._perms:
            n = len(self.table)
            if self.table.source is not None:
                perm = epoch_rows(self.table.source, self.table.weights, seed=self.seed, epoch=epoch,
                                  shuffle=self.shuffle)
            elif self.shuffle:
                gen = torch.Generator().manual_seed(_epoch_seed(self.seed, epoch))
                perm = torch.randperm(n, generator=gen)
            else:
                perm = torch.arange(n)
            # A step spans at most a few epochs; keep only the newest permutations.
            self._perms = {e: p for e, p in self._perms.items() if e >= epoch - 1}
            self._perms[epoch] = perm
        return self._perms[epoch]

    def _rows(self, positions: torch.Tensor) -> torch.Tensor:
        n = self.epoch_size
        first, last = int(positions[0]), int(positions[-1])
        if last - first == len(positions) - 1 and first // n == last // n:
            # Contiguous positions inside one epoch (nearly every step): a slice of its order, faster than the
            # general case below, which counts at small models (bench/RESULTS.md "Fused AdamW, fewer ops around
            # the step, and an in-process A/B").
            return self._perm(first // n)[first % n : last % n + 1]
        epochs = positions // n
        rows = torch.empty_like(positions)
        for epoch in epochs.unique().tolist():
            mask = epochs == epoch
            rows[mask] = self._perm(epoch)[positions[mask] % n]
        return rows

    def next_step(self) -> StepBatch:
        """This rank's grad_accum_steps micro-batches for the next optimizer step, and the global batch's
        target tokens."""
        per_rank, first = self.micro_batch_size * self.grad_accum_steps, self.samples_consumed
        positions = torch.arange(first, first + self.global_batch_size, dtype=torch.long)  # every rank's
        rows = self._rows(positions)
        tokens, processed = int(self._row_tokens[rows].sum()), int(self._row_lengths[rows].sum())
        mine = slice(self.dp_rank * per_rank, (self.dp_rank + 1) * per_rank)
        positions, rows = positions[mine], rows[mine]
        self.samples_consumed += self.global_batch_size
        batches = []
        for pos, row in zip(positions.split(self.micro_batch_size), rows.split(self.micro_batch_size)):
            batches.append(self._micro_batch(row, pos))
        return StepBatch(batches, tokens, processed)

    # Keys added after checkpoints were already written (absent from older ones; see DictState in
    # jobs/checkpoint/state.py).
    ADDED = ("packing",)

    def state_dict(self) -> dict[str, Any]:
        return {"samples_consumed": self.samples_consumed, "seed": self.seed, "num_sequences": len(self.table),
                "packing": self.packing}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # A checkpoint from before the record packed the naive way when it packed at all (data.packing true then
        # meant naive); one example per row is the same table as today.
        saved = state.get("packing", "none" if self.packing == "none" else "naive")
        if saved != self.packing:
            raise ValueError(
                f"the checkpoint's run packed its data as {PACKING_SPEC[saved]}, this run packs as "
                f"{PACKING_SPEC[self.packing]}: resuming would train on other sequences from the next step on. "
                f"Set data.packing back to {PACKING_SPEC[saved].split()[0]} to resume, or start a new run"
            )
        n = len(self.table)
        if state["num_sequences"] != n:
            raise ValueError(
                f"the checkpoint's data had {state['num_sequences']} sequences, this run has {n}: the data file, "
                "tokenizer, seq_len or packing changed; resuming would skip or repeat samples. Restore them, "
                "or start a new run"
            )
        if state["seed"] != self.seed:
            raise ValueError(
                f"the checkpoint's data order used seed {state['seed']}, this run has train.seed {self.seed}; "
                "set train.seed back to resume"
            )
        self.samples_consumed = int(state["samples_consumed"])


# ---------------------------------------------------------------- evaluation


class EvalSplit(NamedTuple):
    train: Any  # a SequenceTable, or a preference table (data/pairtable.py)
    eval: Any
    train_rows: torch.Tensor  # places of train's rows in the packed table
    eval_rows: torch.Tensor


def split_eval(table: Any, fraction: float, seed: int) -> EvalSplit:
    """Hold out ``fraction`` of the packed sequences (or a preference table's rows: whole pairs, or labelled
    answers) for evaluation, chosen from ``seed``.

    At least one row each way; the rows keep their table order on both sides. The same table and seed give
    the same split on every rank, every start and any world size.
    """
    n = len(table)
    n_eval = max(1, round(fraction * n))
    if n_eval >= n:
        raise ValueError(f"data.eval_fraction {fraction} of {n} sequences leaves none to train on; lower it or "
                         "add data")
    gen = torch.Generator().manual_seed(_epoch_seed(seed, -1))  # epochs count from 0: -1 never orders training
    perm = torch.randperm(n, generator=gen)
    eval_rows, train_rows = perm[:n_eval].sort().values, perm[n_eval:].sort().values

    def take(rows: torch.Tensor) -> Any:
        # A preference table (data/pairtable.py) takes its own rows: a pair's two answers are one row of it.
        return table_rows(table, rows) if isinstance(table, SequenceTable) else table.take(rows)

    return EvalSplit(take(train_rows), take(eval_rows), train_rows, eval_rows)


def eval_batches(table: SequenceTable, *, micro_batch_size: int, max_batches: int, dp_rank: int,
                 dp_world: int) -> list[MicroBatch]:
    """This rank's evaluation micro-batches: the same every evaluation, each rank its own contiguous slice.

    The set is the whole table (``max_batches`` 0) or its first ``max_batches * micro_batch_size * dp_world``
    rows. Every rank gets the same number of micro-batches (FSDP's gathers are collective): a rank whose slice
    runs short is topped up with micro-batches that hold no target token (labels all IGNORE).
    """
    total = len(table) if not max_batches else min(len(table), max_batches * micro_batch_size * dp_world)
    per_rank = -(-total // dp_world)
    count = -(-per_rank // micro_batch_size)
    start, stop = min(total, dp_rank * per_rank), min(total, (dp_rank + 1) * per_rank)
    rows = torch.arange(start, stop, dtype=torch.long)
    batches = []
    for chunk in rows.split(micro_batch_size):
        batches.append(micro_batch(table, chunk, chunk))
    while len(batches) < count:
        none = torch.zeros(1, dtype=torch.long)
        batch = micro_batch(table, none, none)
        batches.append(dataclasses.replace(batch, labels=torch.full_like(batch.labels, IGNORE)))
    return batches
