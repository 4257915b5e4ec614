"""The worker's examples: JSONL/parquet records (text, prompt/completion, chat) to labelled token ids."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2

from fsdpjob.orchestrator.core.inputs.records import RecordError, iter_records
from fsdpjob.orchestrator.core.jobspec.dataspec import FieldOptions
from fsdpjob.orchestrator.core.jobspec.spec import DataSpec

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


def encode(tokenizer: Any, texts: list[str], offsets: bool = False) -> Any:
    # add_special_tokens=False: bos/eos are placed explicitly, whatever the tokenizer would add on its own.
    return tokenizer(texts, add_special_tokens=False, return_offsets_mapping=offsets)


def bos_ids(tokenizer: Any) -> list[int]:
    return [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []


def eos_ids(tokenizer: Any) -> list[int]:
    return [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []


def _text_examples(records: list[tuple[int, dict]], tokenizer: Any) -> list[Example]:
    encoded = encode(tokenizer, [r["text"] for _, r in records])["input_ids"]
    out = []
    for (line, _), ids in zip(records, encoded):
        ids = bos_ids(tokenizer) + ids + eos_ids(tokenizer)
        out.append(Example(ids, list(ids), line))
    return out


def _prompt_completion_examples(records: list[tuple[int, dict]], tokenizer: Any) -> list[Example]:
    prompts = encode(tokenizer, [r["prompt"] for _, r in records])["input_ids"]
    completions = encode(tokenizer, [r["completion"] for _, r in records])["input_ids"]
    out = []
    for (line, _), p, c in zip(records, prompts, completions):
        p, c = bos_ids(tokenizer) + p, c + eos_ids(tokenizer)
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
    encoded = encode(tokenizer, [text for text, _ in rendered], offsets=True)
    eos = eos_ids(tokenizer)
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
