"""The worker's data: JSONL examples to labelled token ids, fixed-length sequences, and a resumable batch stream."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from itertools import chain
from pathlib import Path
from typing import Any, NamedTuple

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
    truncated: int  # examples cut short to fit seq_len (packing=False only)
    # A mixture (data.sources): each row's source, and the sources' weights (mixture.py draws epochs from them).
    source: torch.Tensor | None = None  # [N] long
    weights: tuple[float, ...] | None = None

    def __len__(self) -> int:
        return self.input_ids.shape[0]


@dataclass(frozen=True)
class MicroBatch:
    input_ids: torch.Tensor  # [mbs, L]
    labels: torch.Tensor  # [mbs, L]
    sample_ids: torch.Tensor  # [mbs] global positions in the stream: unique over the whole run
    sequence_ids: torch.Tensor  # [mbs] rows of the SequenceTable


class StepBatch(NamedTuple):
    """One optimizer step's data on this rank."""

    micro_batches: list[MicroBatch]  # this rank's
    tokens: int  # real target tokens of the whole global batch (every rank's rows): the loss's denominator


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


def build_sequences(examples: list[Example], seq_len: int, packing: bool, pad_id: int) -> SequenceTable:
    """Fixed-length rows: packed (examples concatenated, then cut) or one example per row (cut or padded)."""
    if not examples:
        raise ValueError("no examples to build sequences from")
    if packing:
        ids = torch.tensor(list(chain.from_iterable(e.input_ids for e in examples)), dtype=torch.long)
        labels = torch.tensor(list(chain.from_iterable(e.labels for e in examples)), dtype=torch.long)
        rows = -(-ids.numel() // seq_len)
        pad = rows * seq_len - ids.numel()  # the last row is padded rather than dropped: no data lost
        ids = torch.cat([ids, torch.full((pad,), pad_id, dtype=torch.long)]).view(rows, seq_len)
        labels = torch.cat([labels, torch.full((pad,), IGNORE, dtype=torch.long)]).view(rows, seq_len)
        return SequenceTable(ids, labels, len(examples), 0)
    ids = torch.full((len(examples), seq_len), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), seq_len), IGNORE, dtype=torch.long)
    truncated = 0
    for row, example in enumerate(examples):
        n = min(len(example.input_ids), seq_len)
        truncated += n < len(example.input_ids)
        ids[row, :n] = torch.tensor(example.input_ids[:n], dtype=torch.long)
        labels[row, :n] = torch.tensor(example.labels[:n], dtype=torch.long)
    return SequenceTable(ids, labels, len(examples), truncated)


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
        self.samples_consumed = 0
        self._perms: dict[int, torch.Tensor] = {}
        # Rows an epoch takes: the table's, or with a mixture the sources' shares of it (mixture.py).
        self.epoch_size = len(table) if table.source is None else epoch_size(table.source, table.weights)
        # Every rank holds the whole table, so each counts the global batch's target tokens itself (the loss's
        # denominator) instead of summing the ranks' counts in a collective every step.
        self._row_tokens = row_tokens(table.labels)

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
        tokens = int(self._row_tokens[rows].sum())
        mine = slice(self.dp_rank * per_rank, (self.dp_rank + 1) * per_rank)
        positions, rows = positions[mine], rows[mine]
        self.samples_consumed += self.global_batch_size
        batches = []
        for pos, row in zip(positions.split(self.micro_batch_size), rows.split(self.micro_batch_size)):
            batches.append(MicroBatch(self.table.input_ids[row], self.table.labels[row], pos, row))
        return StepBatch(batches, tokens)

    def state_dict(self) -> dict[str, int]:
        return {"samples_consumed": self.samples_consumed, "seed": self.seed, "num_sequences": len(self.table)}

    def load_state_dict(self, state: dict[str, int]) -> None:
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
        source = table.source[rows] if table.source is not None else None
        return SequenceTable(table.input_ids[rows], table.labels[rows], table.num_examples, table.truncated, source,
                             table.weights)

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
        batches.append(MicroBatch(table.input_ids[chunk], table.labels[chunk], chunk, chunk))
    while len(batches) < count:
        none = torch.zeros(1, dtype=torch.long)
        batches.append(MicroBatch(table.input_ids[none], torch.full_like(table.labels[none], IGNORE), none, none))
    return batches
