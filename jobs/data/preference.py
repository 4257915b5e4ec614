"""Preference data (train.method dpo, orpo, reward: pairs; kto: labelled answers): records to token ids.

Each answer is a sequence of its own, prompt + answer, with the prompt shared by a pair's two answers, tokenized
as TRL 1.16 does (_tokenized): the prompt, and the prompt followed by each answer, in one call each, split where
they stop sharing tokens:
- strings: the tokenizer's own special-token rule (a BOS only where its post-processor adds one) and the EOS
  token's text after each answer that does not end with it (as TRL: a string, tokenized with the rest);
- conversations (TRL's conversational shape): the prompt is its messages rendered by the chat template with the
  generation prompt; an answer is what rendering prompt + answer messages adds to that rendering (a template that
  does not render the prompt as the start of the whole is a DataError at the record), no bos or eos beyond what
  the template writes. Without a prompt field (TRL's implicit prompt) the prompt is the longest leading run of
  messages chosen and rejected share: it must be non-empty and leave each side at least one message.
kto's answers follow the same rules, one sequence each; a file whose labels are all alike is refused.

Length rules: a sequence (prompt + answer) is at most data.seq_len tokens.
- A prompt that alone leaves no room for one answer token is a DataError at its file and line, naming the
  prompt's field and the numbers ("raise data.seq_len to at least N or shorten the prompt").
- long_examples truncate cuts the END of each answer that does not fit; the prompt is kept whole (the answer's
  probability is conditioned on all of it).
- drop leaves the whole pair out (both answers; for kto the answer).
- split is refused by the spec (an answer cut away from its prompt means nothing).
What truncate and drop did is counted on the list returned (``Fitted.truncated`` and ``.dropped``, with
``.read``, the records read); the tables carry the counts for the data event.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import jinja2

from fsdpjob.orchestrator.core.inputs.promptroom import prompt_room_problem
from fsdpjob.orchestrator.core.inputs.records import WithMargin, implicit_prompt
from fsdpjob.orchestrator.core.jobspec.dataspec import DataSource
from fsdpjob.orchestrator.core.jobspec.spec import DataSpec

from .examples import DataError
from .pairtable import (
    PairTable,
    UnpairedTable,
    build_pair_table,
    build_unpaired_table,
    mixture_table,
    pad_id_of,
)
from .sources import Records, eval_spec, load_records

PAIR_ANSWERS = ("chosen", "rejected")
KTO_ANSWERS = ("completion",)


@dataclass(frozen=True)
class Pair:
    prompt_ids: list[int]
    chosen_ids: list[int]
    rejected_ids: list[int]
    line: int  # the record's line (JSONL) or 1-based row (tables) in its file
    margin: float | None = None  # reward's margin_field: how far the chosen score must beat the rejected


@dataclass(frozen=True)
class Unpaired:
    prompt_ids: list[int]
    completion_ids: list[int]
    desirable: bool
    line: int


class Fitted(list):
    """The examples that fit data.seq_len, with what the length rules did to the others."""

    def __init__(self, items: list, *, read: int, truncated: int, dropped: int):
        super().__init__(items)
        self.read = read  # records read, dropped ones included
        self.truncated = truncated  # records with an answer cut at its end
        self.dropped = dropped  # records left out (long_examples drop)


class _Rendered(NamedTuple):
    prompt: str
    answers: list[str]
    conversation: bool


# ---------------------------------------------------------------- records to text


def render_chat(tokenizer: Any, messages: list[dict], generation_prompt: bool) -> str:
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    except jinja2.TemplateError as exc:  # raised by the template itself, e.g. roles out of order
        raise ValueError(f"the chat template rejected this conversation: {exc}") from None


def _render_record(tokenizer: Any, record: dict[str, Any], roles: tuple[str, ...]) -> _Rendered:
    answers = [record[role] for role in roles]
    if not isinstance(answers[0], list):
        return _Rendered(record["prompt"], answers, False)
    prompt = record.get("prompt")
    if prompt is None:
        prompt, answers = implicit_prompt(answers)
    head = render_chat(tokenizer, prompt, True)
    texts = []
    for role, answer in zip(roles, answers):
        whole = render_chat(tokenizer, prompt + answer, False)
        if not whole.startswith(head):
            raise ValueError(f"the chat template renders the prompt with the generation prompt as {head[-60:]!r} "
                             f"(its end), which is not how the conversation with the {role} answer starts: the "
                             "answer's tokens cannot be told from the prompt's; use a template that renders "
                             "earlier turns the same whatever follows them")
        texts.append(whole[len(head):])
    return _Rendered(head, texts, True)


# ---------------------------------------------------------------- text to token ids


def _tokenized(records: Records, tokenizer: Any, roles: tuple[str, ...]) -> list[tuple[list[int], list[list[int]]]]:
    """(prompt ids, each answer's ids) of every record, in order; DataError at the record's file and line.

    As TRL 1.16's DPOTrainer and KTOTrainer (_prepare_dataset): the prompt alone and the prompt followed by each
    answer are tokenized in one call each, and each answer is what follows the longest prefix the prompt shares
    with all of them (a merge across the boundary moves into the answer, not a token of its own). Strings get the
    tokenizer's own special-token rule (a BOS where its post-processor adds one, none where it does not) and the
    EOS token's text after each answer that does not end with it; a conversation is the chat template's text,
    which writes its own special tokens (apply_chat_template's add_special_tokens=False)."""
    rendered = []
    for key, record in records.items:
        file, line = records.where(key)
        if isinstance(record[roles[0]], list) and not getattr(tokenizer, "chat_template", None):
            raise DataError("the pair is a conversation but the tokenizer has no chat template; give strings or "
                            "add a chat template", file=file, line=line)
        try:
            rendered.append(_render_record(tokenizer, record, roles))
        except ValueError as exc:
            raise DataError(str(exc), file=file, line=line) from None
    eos = tokenizer.eos_token or ""
    out: list[Any] = [None] * len(rendered)
    for conversation in (False, True):
        at = [i for i, r in enumerate(rendered) if r.conversation == conversation]
        if not at:
            continue
        special = not conversation  # strings: the tokenizer's rule; the template wrote a conversation's own
        ends = "" if conversation else eos  # TRL's add_eos, for strings only
        prompts = tokenizer([rendered[i].prompt for i in at], add_special_tokens=special)["input_ids"]
        wholes = [tokenizer([_with_end(rendered[i].prompt, rendered[i].answers[k], ends) for i in at],
                            add_special_tokens=special)["input_ids"] for k in range(len(roles))]
        for j, i in enumerate(at):
            shared = min(_common_prefix(prompts[j], w[j]) for w in wholes)
            out[i] = (prompts[j][:shared], [w[j][shared:] for w in wholes])
    return out


def _with_end(prompt: str, answer: str, end: str) -> str:
    return prompt + (answer if answer.endswith(end) else answer + end)


def _common_prefix(ids: list[int], other: list[int]) -> int:
    n = 0
    while n < min(len(ids), len(other)) and ids[n] == other[n]:
        n += 1
    return n


def _fit(tokenized: list[tuple[list[int], list[list[int]]]], records: Records, source: Any,
         data: DataSpec) -> tuple[list[int], list[list[list[int]]], int]:
    """Which records stay (their indices), their answers within data.seq_len, and how many were truncated."""
    seq_len, kept, answers, truncated = data.seq_len, [], [], 0
    for i, (prompt, parts) in enumerate(tokenized):
        room = seq_len - len(prompt)
        if room < 1:
            file, line = records.where(records.items[i][0])
            field = source.fields["prompt"] if "prompt" in records.items[i][1] else None  # None: implicit prompt
            raise DataError(prompt_room_problem(field, len(prompt), seq_len), file=file, line=line)
        if all(len(p) <= room for p in parts):
            kept.append(i)
            answers.append(parts)
        elif data.long_examples != "drop":  # truncate: the spec refuses split for preference methods
            kept.append(i)
            answers.append([p[:room] for p in parts])
            truncated += 1
    if not kept:
        raise DataError(f"every record is longer than data.seq_len {seq_len} and data.long_examples is drop: no "
                        "data left; raise data.seq_len or use long_examples: truncate", file=source.path, line=None)
    return kept, answers, truncated


# ---------------------------------------------------------------- reading


def _source(data: DataSpec, path: str | Path | None | DataSource) -> DataSource:
    """The one source to read: data.path's, eval_path's (with its split), ``path`` read with data's settings, or
    ``path`` itself where it is a source (one of a mixture's, data.inputs())."""
    if isinstance(path, DataSource):
        return path
    if path is None or str(path) == str(data.path):
        return data.inputs()[0]
    if data.eval_path is not None and str(path) == str(data.eval_path):
        return eval_spec(data).inputs()[0]
    return data.model_copy(update={"path": str(path), "sources": None, "split": None}).inputs()[0]


def read_pairs(data: DataSpec, tokenizer: Any, path: str | Path | DataSource | None = None,
               margin_field: str | None = None) -> Fitted:
    """Every pair of ``path`` (default data.path; or a source of data.sources) as token ids within data.seq_len
    (module docstring); with ``margin_field`` (reward.margin_field) each pair's margin, a number every record must
    hold."""
    source: Any = _source(data, path)
    if margin_field is not None:
        source = WithMargin(source, margin_field)
    records = load_records(source)
    tokenized = _tokenized(records, tokenizer, PAIR_ANSWERS)
    kept, answers, truncated = _fit(tokenized, records, source, data)
    pairs = []
    for i, (chosen, rejected) in zip(kept, answers):
        key, record = records.items[i]
        margin = float(record["margin"]) if margin_field is not None else None
        pairs.append(Pair(tokenized[i][0], chosen, rejected, records.where(key)[1], margin))
    return Fitted(pairs, read=len(tokenized), truncated=truncated, dropped=len(tokenized) - len(kept))


def _check_labels(records: Records, source: Any) -> None:
    labels = {record["label"] for _, record in records.items}
    if len(labels) == 1:
        file, line = records.where(records.items[0][0])
        value = "true (desirable)" if labels.pop() else "false (undesirable)"
        raise DataError(f"kto needs desirable and undesirable answers: every label in field "
                        f"{source.fields['label']!r} (data.label_field) is {value}; add answers of the other "
                        "kind", file=file, line=line)


def read_unpaired(data: DataSpec, tokenizer: Any, path: str | Path | DataSource | None = None) -> Fitted:
    """Every labelled answer of ``path`` (default data.path; or a source of data.sources) for kto, as token ids
    within data.seq_len. Each source needs answers of both labels (validate checks them so, file by file)."""
    source = _source(data, path)
    records = load_records(source)
    _check_labels(records, source)
    tokenized = _tokenized(records, tokenizer, KTO_ANSWERS)
    kept, answers, truncated = _fit(tokenized, records, source, data)
    out = []
    for i, (completion,) in zip(kept, answers):
        key, record = records.items[i]
        out.append(Unpaired(tokenized[i][0], completion, bool(record["label"]), records.where(key)[1]))
    if len({a.desirable for a in out}) == 1:
        raise DataError(f"long_examples drop left answers of one label only ({len(out)} of {len(tokenized)} kept): "
                        "kto needs desirable and undesirable answers; raise data.seq_len or use long_examples: "
                        "truncate", file=source.path, line=None)
    return Fitted(out, read=len(tokenized), truncated=truncated, dropped=len(tokenized) - len(kept))


def read_pair_table(data: DataSpec, tokenizer: Any, margin_field: str | None = None,
                    path: str | Path | None = None) -> PairTable:
    """The pair table of data.path, or of a mixture's sources (each read on its own, then one table with each
    row's source and the weights), or of ``path`` (data.eval_path for the eval data), padded to data.seq_len."""
    def table(source: str | Path | DataSource | None) -> PairTable:
        return build_pair_table(read_pairs(data, tokenizer, source, margin_field), data.seq_len, pad_id_of(tokenizer))
    return _tables(data, path, table)


def read_unpaired_table(data: DataSpec, tokenizer: Any, path: str | Path | None = None) -> UnpairedTable:
    """kto's table of data.path, of a mixture's sources, or of ``path`` (data.eval_path), padded to data.seq_len."""
    def table(source: str | Path | DataSource | None) -> UnpairedTable:
        return build_unpaired_table(read_unpaired(data, tokenizer, source), data.seq_len, pad_id_of(tokenizer))
    return _tables(data, path, table)


def _tables(data: DataSpec, path: str | Path | None, table: Any) -> Any:
    if path is not None or data.sources is None:
        return table(path)
    sources = data.inputs()
    return mixture_table([table(source) for source in sources], [source.weight for source in sources])
