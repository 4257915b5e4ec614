"""The record rules both sides share: what makes a JSONL line or a table row an example (the login node checks
the first SCAN_LINES of each source, the worker every record it reads)."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fsdpjob.orchestrator.core.jobspec.dataspec import FieldOptions

SCAN_LINES = 10_000  # the login node reads this many data lines; the worker validates the rest
_SETTING = {"text": "data.text_field", "prompt": "data.prompt_field", "completion": "data.completion_field",
            "messages": "data.messages_field", "chosen": "data.chosen_field", "rejected": "data.rejected_field",
            "label": "data.label_field", "margin": "reward.margin_field"}  # fmt: skip
_ANSWERS = ("chosen", "rejected")  # a pair's answers: strings, or messages where the pair is a conversation


class WithMargin:
    """A source read with one more role, a reward pair's margin (a number; record_fields checks it): its field is
    the reward section's (reward.margin_field), not the data section's. Everything else is the source's."""

    def __init__(self, source: Any, field: str):
        self._source, self._field = source, field

    def __getattr__(self, name: str) -> Any:
        return getattr(self._source, name)

    @property
    def fields(self) -> dict[str, str]:
        return {**self._source.fields, "margin": self._field}


class RecordError(ValueError):
    """A JSONL line that cannot be used as an example; ``line`` is 1-based."""

    def __init__(self, message: str, line: int):
        self.message = message
        self.line = line
        super().__init__(f"line {line}: {message}")


def _json_type(value: Any) -> str:
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}
    return names.get(type(value), "a number")


def _messages_problem(value: Any) -> str | None:
    if not isinstance(value, list):
        return f"expected a list of {{role, content}} objects, found {_json_type(value)}"
    if not value:
        return "the conversation is empty"
    for i, message in enumerate(value):
        if not isinstance(message, dict):
            return f"message {i} is {_json_type(message)}, not a {{role, content}} object"
        for key in ("role", "content"):
            if key not in message:
                return f"message {i} has no {key!r}"
            if not isinstance(message[key], str):
                return f"message {i}: {key!r} must be a string, found {_json_type(message[key])}"
    return None


def parse_object(raw: bytes, line: int) -> Any:
    """One JSONL line as JSON (grpo's prompts keep every field of it: the reward functions read them)."""
    try:
        # utf-8-sig: a file saved with a BOM (Windows editors, Excel) starts its first line with one
        return json.loads(raw.decode("utf-8-sig"))
    except UnicodeDecodeError as exc:
        raise RecordError(f"not valid UTF-8 (byte {exc.start}); save the file as UTF-8", line) from None
    except json.JSONDecodeError as exc:
        message = f"malformed JSON ({exc.msg} at column {exc.colno}); each line must be one JSON object"
        raise RecordError(message, line) from None


def parse_record(raw: bytes, data: FieldOptions, line: int) -> dict[str, Any]:
    """The configured fields of one JSONL line, keyed by role (text, prompt, completion or messages)."""
    return record_fields(parse_object(raw, line), data, line)


def record_fields(obj: Any, data: FieldOptions, line: int) -> dict[str, Any]:
    """The configured fields of one record (a JSON object, or a table row as a dict), keyed by role."""
    if not isinstance(obj, dict):
        raise RecordError(f"expected a JSON object, found {_json_type(obj)}", line)
    out: dict[str, Any] = {}
    for role, field in data.fields.items():
        if field not in obj:
            present = ", ".join(repr(k) for k in list(obj)[:8]) or "no fields"
            raise RecordError(f"missing field {field!r} (set by {_SETTING[role]}); this line has {present}", line)
        value = obj[field]
        if role == "messages" or (role in _ANSWERS + ("prompt",) and data.shape in ("preference", "prompts")
                                  and isinstance(value, list)):
            problem = _messages_problem(value)
        elif role == "label":
            problem = None if isinstance(value, bool) else f"expected true or false, found {_json_type(value)}"
        elif role == "margin":  # a reward pair's margin: read where the caller asks for it (jobs/data/preference.py)
            problem = _margin_problem(value)
        else:
            problem = None if isinstance(value, str) else f"expected a string, found {_json_type(value)}"
        if problem:
            raise RecordError(f"field {field!r}: {problem}", line)
        out[role] = value
    if data.shape == "preference" and (problem := _pair_kinds(out) or _conversation_problem(out, data.fields)):
        raise RecordError(problem, line)
    return out


def _margin_problem(value: Any) -> str | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return f"expected a number (the pair's margin), found {_json_type(value)}"
    return None if math.isfinite(value) else f"expected a finite number (the pair's margin), found {value}"


def _pair_kinds(pair: dict[str, Any]) -> str | None:
    """A pair is text (every field a string) or a conversation (every field messages), not both."""
    kinds = {role: isinstance(value, list) for role, value in pair.items() if role in _ANSWERS + ("prompt",)}
    if len(set(kinds.values())) > 1:
        texts = [r for r, is_list in kinds.items() if not is_list]
        lists = [r for r, is_list in kinds.items() if is_list]
        return (f"{' and '.join(lists)} {'is' if len(lists) == 1 else 'are'} messages but {' and '.join(texts)} "
                f"{'is a string' if len(texts) == 1 else 'are strings'}; give every field of a pair the same kind")
    if "prompt" not in pair and not kinds.get("chosen"):
        return ("the pair has no prompt field and its answers are strings; set data.prompt_field (an implicit "
                "prompt needs chosen and rejected as conversations)")
    return None


def implicit_prompt(answers: list[list[dict]]) -> tuple[list[dict], list[list[dict]]]:
    """The messages every conversation starts with (the prompt) and what each has after them (its answer);
    ValueError where they share no first message or one has nothing after the shared ones."""
    n, shortest = 0, min(len(a) for a in answers)
    while n < shortest and all(a[n] == answers[0][n] for a in answers):
        n += 1
    if n == 0:
        raise ValueError("chosen and rejected share no first message: without data.prompt_field the prompt is the "
                         "messages both conversations start with; give the pair its prompt's messages or set "
                         "data.prompt_field")
    if n == shortest:
        raise ValueError(f"chosen and rejected share their first {n} messages and one has nothing after them: "
                         "each needs at least one answer message after the shared prompt")
    return answers[0][:n], [a[n:] for a in answers]


def _conversation_problem(pair: dict[str, Any], fields: dict[str, str]) -> str | None:
    """A conversation pair's prompt (its prompt field, or the messages both answers start with) and answers: each
    answer is the assistant's (its first message role assistant; later ones assistant or tool), as the chat
    template's generation prompt opens it; anything else the workers could not split from the prompt."""
    answers = [pair[role] for role in _ANSWERS if isinstance(pair.get(role), list)]
    if len(answers) != len(_ANSWERS):
        return None
    if "prompt" not in pair:
        try:
            _, answers = implicit_prompt(answers)
        except ValueError as exc:
            return f"fields {fields['chosen']!r} and {fields['rejected']!r}: {exc}"
    for role, answer in zip(_ANSWERS, answers):
        for i, message in enumerate(answer):
            if message["role"] != "assistant" and (i == 0 or message["role"] != "tool"):
                return (f"field {fields[role]!r}: the answer's message {i} has role {message['role']!r}; an answer "
                        "is written by the assistant (role assistant, then assistant or tool): move the other "
                        "turns into the prompt")
    return None


def iter_records(path: str | Path, data: FieldOptions,
                 limit: int | None = None) -> Iterator[tuple[int, dict[str, Any]]]:
    """Yield (line number, fields) for each non-blank line of a JSONL file, up to line ``limit``."""
    with open(path, "rb") as f:
        for line, raw in enumerate(f, 1):
            if limit is not None and line > limit:
                return
            if raw.strip():
                yield line, parse_record(raw, data, line)
