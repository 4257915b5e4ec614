"""The worker's data in every format, and mixtures: the data section read to one packed SequenceTable.

JSONL files and parquet files are read as orchestrator/core/inputs/dataformats.py finds them (the login node's
checks read the same way), a save_to_disk folder through `datasets.load_from_disk`. Every record meets the
JSONL rules (inputs.record_fields), so a bad row fails at its file and row like a bad line at its line. Each
source is tokenized and packed on its own, so a packed row never mixes sources; a mixture's table is the
sources' rows one after the other, with each row's source and the weights (mixture.py makes epochs of them).
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from fsdpjob.orchestrator.core.inputs.dataformats import (
    Located,
    RowError,
    SourceProblem,
    eval_data,
    locate,
    plain_cell,
    source_records,
)
from fsdpjob.orchestrator.core.inputs.records import RecordError, record_fields
from fsdpjob.orchestrator.core.jobspec.dataspec import DataSource
from fsdpjob.orchestrator.core.jobspec.spec import DataSpec
from fsdpjob.orchestrator.core.runfolder import heartbeat

from .examples import DataError, Example, examples_from_records
from .packing import SequenceTable, build_sequences

_BATCH_ROWS = 1024


def _saved_rows(located: Located, source: DataSource) -> Iterator[tuple[Path, int, dict[str, Any]]]:
    """(folder, 1-based row, fields by role) of a save_to_disk data set, read by `datasets` as Arrow batches (the
    python format would turn a list of message structs into a struct of lists)."""
    try:
        import datasets
    except ImportError:
        raise SourceProblem("reading a save_to_disk folder needs datasets: pip install 'fsdpjob[datasets]'") from None
    dataset = datasets.load_from_disk(str(located.root))
    columns = list(dict.fromkeys(source.fields.values()))
    if missing := [c for c in columns if c not in dataset.column_names]:
        raise SourceProblem(f"{located.root} has no column {missing[0]!r} (columns: {', '.join(dataset.column_names)})")
    row = 0
    for batch in dataset.select_columns(columns).with_format("arrow").iter(batch_size=_BATCH_ROWS):
        for record in batch.to_pylist():
            row += 1
            try:
                yield located.root, row, record_fields({k: plain_cell(v) for k, v in record.items()}, source, row)
            except RecordError as exc:
                raise RowError(exc.message, located.root, row) from None


class Records:
    """A source's records keyed 1, 2, ... (the tokenizer's errors name the key) and where each came from."""

    def __init__(self) -> None:
        self.items: list[tuple[int, dict[str, Any]]] = []
        self.files: list[Path] = []
        self._file_of, self._line_of = array("l"), array("q")  # compact: one entry per record

    def add(self, file: Path, line: int, fields: dict[str, Any]) -> None:
        if not self.files or self.files[-1] != file:
            self.files.append(file)
        self.items.append((len(self.items) + 1, fields))
        self._file_of.append(len(self.files) - 1)
        self._line_of.append(line)

    def where(self, key: int) -> tuple[Path, int]:
        return self.files[self._file_of[key - 1]], self._line_of[key - 1]


def load_records(source: DataSource) -> Records:
    """Every record of ``source``; DataError at the file and line (or row) of the first bad one."""
    records = Records()
    try:
        located = locate(source)
        rows = _saved_rows(located, source) if located.format == "save_to_disk" else source_records(located, source)
        for file, line, fields in rows:
            records.add(file, line, fields)
    except SourceProblem as exc:
        raise DataError(str(exc), file=source.path, line=None) from None
    except RowError as exc:
        raise DataError(exc.message, file=exc.file, line=exc.line) from None
    if not records.items:
        raise DataError("no examples: the data is empty; give at least one record", file=source.path, line=None)
    return records


TOKENIZE_CHUNK = 10_000  # examples per batch call to the tokenizer


def read_source(source: DataSource, tokenizer: Any) -> list[Example]:
    """Tokenized examples of one source, in file and row order."""
    records = load_records(source)
    items, out = records.items, []
    try:
        # In chunks (each example's tokens do not depend on the others'): the heartbeat carries the count, so a
        # long tokenization shows it moves.
        for start in range(0, len(items), TOKENIZE_CHUNK):
            out += examples_from_records(items[start:start + TOKENIZE_CHUNK], source, tokenizer, source.path)
            heartbeat.report(examples_tokenized=len(out), examples=len(items))
        return out
    except DataError as exc:  # it names a record's key: say its file and line
        if exc.line is None:
            raise
        file, line = records.where(exc.line)
        raise DataError(exc.message, file=file, line=line) from None


def build_table(data: DataSpec, tokenizer: Any, pad_id: int) -> SequenceTable:
    """The packed table of ``data``: one source's, or a mixture's rows with their sources and weights."""
    sources = data.inputs()
    tables = [build_sequences(read_source(s, tokenizer), data.seq_len, data.packing, pad_id, data.long_examples)
              for s in sources]
    if data.sources is None:
        return tables[0]

    def cat(name: str) -> torch.Tensor | None:
        parts = [getattr(t, name) for t in tables]
        return torch.cat(parts) if all(p is not None for p in parts) else None

    return SequenceTable(
        torch.cat([t.input_ids for t in tables]), torch.cat([t.labels for t in tables]),
        sum(t.num_examples for t in tables), sum(t.truncated for t in tables),
        torch.cat([torch.full((len(t),), i, dtype=torch.long) for i, t in enumerate(tables)]),
        tuple(s.weight for s in sources), cat("position_ids"), cat("lengths"),
        sum(t.split for t in tables), sum(t.dropped for t in tables),
    )


def eval_spec(data: DataSpec) -> DataSpec:
    """The data section for ``data.eval_path`` (dataformats.eval_data), or DataError when its split is unclear."""
    try:
        return eval_data(data)
    except SourceProblem as exc:
        raise DataError(str(exc), file=data.eval_path, line=None) from None


def data_files(data: DataSpec) -> list[Path]:
    """Every file whose bytes the packed table depends on, source by source (the data cache hashes them)."""
    files = []
    for source in data.inputs():
        try:
            files += locate(source).hashed
        except SourceProblem as exc:
            raise DataError(str(exc), file=source.path, line=None) from None
    return files
