"""GRPO's prompt records (data shape ``prompts``): each record's prompt and every other field of it, which the reward
functions receive as keywords. Both sides read them here: the login node (the reward functions' signatures against
the field names, the prompts' room in data.seq_len) and the worker (jobs/grpo/prompts.py), so the fields a
function validated against are the fields it is called with.

The prompt obeys the record rules of every shape (records.record_fields: a string or chat messages); the other
fields are taken as they are. A field a record lacks but others have is None in it (a table column's null).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from .dataformats import RowError, SourceProblem, locate, plain_cell, schema, table_rows
from .records import SCAN_LINES, RecordError, parse_object, record_fields

if TYPE_CHECKING:
    from fsdpjob.orchestrator.core.jobspec.dataspec import DataSource, DataSpec

# The keywords a reward function gets the prompts and the completions in: no record field may take them.
CALL_KEYWORDS = ("prompts", "completions")


class PromptRecord(NamedTuple):
    file: Path
    line: int  # a JSONL line, or a table's 1-based row
    prompt: Any  # a string, or chat messages
    fields: dict[str, Any]  # every other field of the record


def _jsonl_objects(files: list[Path], limit: int | None) -> Iterator[tuple[Path, int, Any]]:
    for file in files:
        with open(file, "rb") as f:
            for line, raw in enumerate(f, 1):
                if limit is not None and line > limit:
                    break
                if raw.strip():
                    try:
                        yield file, line, parse_object(raw, line)
                    except RecordError as exc:
                        raise RowError(exc.message, file, exc.line) from None


def prompt_records(source: DataSource, limit: int | None = SCAN_LINES) -> Iterator[PromptRecord]:
    """The records of a prompts source, ``limit`` lines (rows) of each file at most (None: all); SourceProblem
    for a source that cannot be read, RowError at the file and line of a bad record."""
    located = locate(source)
    if located.format == "jsonl":
        objects: Iterator[tuple[Path, int, Any]] = _jsonl_objects(located.files, limit)
    else:
        columns = list(schema(located).names)
        objects = ((w, r, {k: plain_cell(v) for k, v in record.items()})
                   for w, r, record in table_rows(located, columns, limit))
    prompt_field = source.fields["prompt"]
    for file, line, obj in objects:
        try:
            prompt = record_fields(obj, source, line)["prompt"]
        except RecordError as exc:
            raise RowError(exc.message, file, exc.line) from None
        yield PromptRecord(file, line, prompt, {k: v for k, v in obj.items() if k != prompt_field})


def field_names(records: list[PromptRecord]) -> list[str]:
    """Every field other than the prompt in ``records``, in the order they first appear."""
    return list(dict.fromkeys(name for record in records for name in record.fields))


def login_field_names(data: DataSpec) -> list[str] | None:
    """The fields of data.path's first SCAN_LINES records besides the prompt (what the reward functions get), or
    None when the data cannot be read (check_data says why)."""
    try:
        return field_names(list(prompt_records(data.inputs()[0])))
    except (SourceProblem, RowError, OSError):
        return None


def keyword_problem(name: str) -> str | None:
    """Why a record field cannot be passed to the reward functions, or None."""
    if name in CALL_KEYWORDS:
        return (f"the records have a field {name!r}, but the reward functions get the {name} in that keyword "
                "(TRL's convention); rename the field")
    return None
