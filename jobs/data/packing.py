"""The worker's data: JSONL examples to labelled token ids, fixed-length sequences, and a resumable batch stream."""

from __future__ import annotations

import bisect
import dataclasses
import hashlib
from dataclasses import dataclass
from itertools import chain
from pathlib import Path
from typing import Any, Literal, NamedTuple

import jinja2
import torch

from fsdpjob.orchestrator.core.dataspec import FieldOptions
from fsdpjob.orchestrator.core.records import RecordError, iter_records
from fsdpjob.orchestrator.core.spec import DataSpec

from .mixture import epoch_rows, epoch_size

IGNORE = -100  # label value the HF loss skips


class DataError(Exception):
    """A data problem the user can fix, located at FILE:LINE."""

    def __init__(self, message: str, *, file: str | Path, line: int | None):
        self.message = message
        self.file = str(file)
        self.line = line
        where = f"{self.file}:{line}" if line is not None else self.file
        super().__init__(f"{where}: {message}")


@dataclass(frozen=True)
class Example:
    input_ids: list[int]
    labels: list[int]  # IGNORE where the token is not a training target
    source_line: int


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


# ---------------------------------------------------------------- reading


def _load_records(data: DataSpec) -> list[tuple[int, dict[str, Any]]]:
    path = Path(data.path)
    if not path.is_file():
        raise DataError("data file not found (or not a file)", file=path, line=None)
    try:
        records = list(iter_records(path, data))
    except RecordError as exc:
        raise DataError(exc.message, file=path, line=exc.line) from None
    if not records:
        raise DataError("the data file is empty; it needs one JSON object per line", file=path, line=1)
    return records


def _encode(tokenizer: Any, texts: list[str], offsets: bool = False) -> Any:
    # add_special_tokens=False: bos/eos are placed explicitly, whatever the tokenizer would add on its own.
    return tokenizer(texts, add_special_tokens=False, return_offsets_mapping=offsets)


def _bos(tokenizer: Any) -> list[int]:
    return [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []


def _eos(tokenizer: Any) -> list[int]:
    return [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []


def _text_examples(records: list[tuple[int, dict]], tokenizer: Any) -> list[Example]:
    encoded = _encode(tokenizer, [r["text"] for _, r in records])["input_ids"]
    out = []
    for (line, _), ids in zip(records, encoded):
        ids = _bos(tokenizer) + ids + _eos(tokenizer)
        out.append(Example(ids, list(ids), line))
    return out


def _prompt_completion_examples(records: list[tuple[int, dict]], tokenizer: Any) -> list[Example]:
    prompts = _encode(tokenizer, [r["prompt"] for _, r in records])["input_ids"]
    completions = _encode(tokenizer, [r["completion"] for _, r in records])["input_ids"]
    out = []
    for (line, _), p, c in zip(records, prompts, completions):
        p, c = _bos(tokenizer) + p, c + _eos(tokenizer)
        out.append(Example(p + c, [IGNORE] * len(p) + c, line))
    return out


def _render(tokenizer: Any, messages: list[dict], generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def _assistant_spans(tokenizer: Any, messages: list[dict], full: str) -> list[tuple[int, int]]:
    """Character spans of the assistant turns (with their end-of-turn marker) in the rendered chat.

    Each turn i is what rendering messages[:i+1] adds to messages[:i] plus the generation prompt. For
    templates that render earlier turns differently from the last one (e.g. dropping reasoning), that
    prefix rule fails and the turn's content is located in the full rendering instead.
    """
    spans, cursor = [], 0
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            # Move past this turn so a later assistant reply that repeats its words is not found here.
            found = full.find(message["content"], cursor)
            cursor = found + len(message["content"]) if found >= 0 else cursor
            continue
        try:
            before = _render(tokenizer, messages[:i], True)
            upto = _render(tokenizer, messages[: i + 1], False)
        except jinja2.TemplateError:  # some templates refuse partial conversations; fall back below
            before = upto = None
        if before is not None and upto.startswith(before) and full.startswith(upto) and len(upto) > len(before):
            spans.append((len(before), len(upto)))
            cursor = len(upto)
            continue
        start = full.find(message["content"], cursor)
        if start < 0:
            raise ValueError(f"cannot find assistant message {i} in the chat template's rendering")
        end = start + len(message["content"])
        eos = tokenizer.eos_token or ""
        if eos and full.startswith(eos, end):
            end += len(eos)
        spans.append((start, end))
        cursor = end
    return spans


def _chat_example(tokenizer: Any, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    try:
        full = _render(tokenizer, messages, False)
    except jinja2.TemplateError as exc:  # raised by the template itself, e.g. roles out of order
        raise ValueError(f"the chat template rejected this conversation: {exc}") from None
    return full, _assistant_spans(tokenizer, messages, full)


def _overlaps(start: int, end: int, spans: list[tuple[int, int]]) -> bool:
    """A token is a target when its characters touch an assistant span: a token merging the prompt's last
    space with the reply's first word (' Hello') is part of the reply the model must produce."""
    end = max(end, start + 1)  # zero-width offsets (some special tokens) count by their position
    return any(start < b and a < end for a, b in spans)


def _chat_examples(records: list[tuple[int, dict]], tokenizer: Any, path: str) -> list[Example]:
    first_line = records[0][0]
    if not getattr(tokenizer, "chat_template", None):
        raise DataError("the tokenizer has no chat template; use text_field or prompt/completion fields",
                        file=path, line=first_line)
    if not getattr(tokenizer, "is_fast", False):
        raise DataError("chat masking needs a fast tokenizer (tokenizer.json) for character offsets",
                        file=path, line=first_line)
    rendered = []
    for line, record in records:
        try:
            rendered.append(_chat_example(tokenizer, record["messages"]))
        except ValueError as exc:
            raise DataError(str(exc), file=path, line=line) from None
    encoded = _encode(tokenizer, [text for text, _ in rendered], offsets=True)
    eos = _eos(tokenizer)
    out = []
    for (line, _), (_, spans), ids, offsets in zip(records, rendered, encoded["input_ids"], encoded["offset_mapping"]):
        labels = [tok if _overlaps(start, end, spans) else IGNORE for tok, (start, end) in zip(ids, offsets)]
        if eos and ids[-1:] != eos:  # an unlabelled separator so packed conversations stay apart
            ids, labels = ids + eos, labels + [IGNORE]
        out.append(Example(ids, labels, line))
    return out


def read_examples(data: DataSpec, tokenizer: Any) -> list[Example]:
    """Tokenize every line of ``data.path``. Each example ends with eos (when the tokenizer has one)."""
    return examples_from_records(_load_records(data), data, tokenizer, data.path)


def examples_from_records(records: list[tuple[int, dict]], data: FieldOptions, tokenizer: Any,
                          path: str | Path) -> list[Example]:
    """Tokenize records (line, fields by role) of ``data``'s shape; DataErrors name ``path`` and the line."""
    if data.shape == "prompt_completion":
        return _prompt_completion_examples(records, tokenizer)
    if data.shape == "chat":
        return _chat_examples(records, tokenizer, path)
    return _text_examples(records, tokenizer)


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
        self._row_tokens = row_tokens(table.labels)
        self._row_lengths = table.row_lengths()

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
            batches.append(micro_batch(self.table, row, pos))
        return StepBatch(batches, tokens, processed)

    # Keys added after checkpoints were already written (absent from older ones; see ckpt_state.DictState).
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
    train: SequenceTable
    eval: SequenceTable
    train_rows: torch.Tensor  # places of train's rows in the packed table
    eval_rows: torch.Tensor


def split_eval(table: SequenceTable, fraction: float, seed: int) -> EvalSplit:
    """Hold out ``fraction`` of the packed sequences for evaluation, chosen from ``seed``.

    At least one sequence each way; the rows keep their table order on both sides. The same table and seed give
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

    def take(rows: torch.Tensor) -> SequenceTable:
        return table_rows(table, rows)

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
