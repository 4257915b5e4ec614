"""GRPO's prompts (data shape ``prompts``): every record of data.path as the prompt to generate for, its token ids,
and the record's other fields, which the reward functions receive (orchestrator/core/inputs/promptrecords.py reads
the records, as the login node's checks read them).

Token ids, as preference data's prompts (jobs/data/preference.py):
- a string prompt is bos + tokens(prompt) (add_special_tokens=False: bos placed here, whatever the tokenizer adds);
- chat messages are rendered by the chat template with the generation prompt and tokenized as they are: the
  template writes its own special tokens.
A prompt longer than ``max_prompt_tokens`` (data.seq_len - grpo.max_new_tokens) is a DataError at its file and line,
in the login check's words (validate refuses the string prompts it reads; a conversation is only known here).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from fsdpjob.orchestrator.core.inputs.dataformats import RowError, SourceProblem
from fsdpjob.orchestrator.core.inputs.promptrecords import PromptRecord, field_names, keyword_problem, prompt_records
from fsdpjob.orchestrator.core.inputs.promptroom import prompt_room_problem
from fsdpjob.orchestrator.core.jobspec.spec import DataSpec, JobSpec
from fsdpjob.orchestrator.core.runfolder import runlog

from ..data.examples import DataError, bos_ids, encode
from ..data.pairtable import tensors_fingerprint
from ..data.preference import render_chat


@dataclass(frozen=True)
class PromptTable:
    """One row per record, in file order."""

    prompts: list[Any]  # each as the record gives it: a string, or chat messages
    prompt_ids: list[list[int]]  # the prompt's token ids (module docstring)
    fields: list[dict[str, Any]]  # every other field of the record (None where the record lacks one others have)
    places: list[str]  # "file:line" of each record, for errors that name it

    def __len__(self) -> int:
        return len(self.prompts)

    @property
    def field_names(self) -> list[str]:
        """The fields the reward functions get as keywords, in the order the records first give them."""
        return list(self.fields[0]) if self.fields else []

    def fingerprint(self) -> str:
        """A hash of the token ids (pairtable's): the same prompts give the same value in any process and host,
        and any change to an id, a prompt's length or the row count changes it."""
        lengths = torch.tensor([len(ids) for ids in self.prompt_ids], dtype=torch.long)
        flat = torch.tensor([i for ids in self.prompt_ids for i in ids], dtype=torch.long)
        return tensors_fingerprint([lengths, flat])


def _records(data: DataSpec) -> list[PromptRecord]:
    source = data.inputs()[0]
    try:
        records = list(prompt_records(source, limit=None))
    except SourceProblem as exc:
        raise DataError(str(exc), file=source.path, line=None) from None
    except RowError as exc:
        raise DataError(exc.message, file=exc.file, line=exc.line) from None
    if not records:
        raise DataError("no prompts: the data is empty; give at least one record", file=source.path, line=None)
    return records


def _text(tokenizer: Any, record: PromptRecord) -> str:
    if isinstance(record.prompt, str):
        return record.prompt
    if not getattr(tokenizer, "chat_template", None):
        raise DataError("the prompt is a conversation but the tokenizer has no chat template; give strings or add a "
                        "chat template", file=record.file, line=record.line)
    try:
        return render_chat(tokenizer, record.prompt, True)
    except ValueError as exc:
        raise DataError(str(exc), file=record.file, line=record.line) from None


def read_prompt_table(data: DataSpec, tokenizer: Any, *, max_prompt_tokens: int) -> PromptTable:
    """Every record of data.path as a PromptTable row; DataError at the file and line of a bad or too long one."""
    records = _records(data)
    names = field_names(records)
    for name in names:
        if problem := keyword_problem(name):
            raise DataError(problem, file=records[0].file, line=records[0].line)
    encoded = encode(tokenizer, [_text(tokenizer, r) for r in records])["input_ids"]
    bos = bos_ids(tokenizer)
    prompt_ids = [list(ids) if not isinstance(r.prompt, str) else bos + list(ids) for r, ids in zip(records, encoded)]
    field = data.inputs()[0].fields["prompt"]
    for record, ids in zip(records, prompt_ids):
        if len(ids) > max_prompt_tokens:
            problem = prompt_room_problem(field, len(ids), data.seq_len, data.seq_len - max_prompt_tokens)
            raise DataError(problem, file=record.file, line=record.line)
    return PromptTable(prompts=[r.prompt for r in records], prompt_ids=prompt_ids,
                       fields=[{name: r.fields.get(name) for name in names} for r in records],
                       places=[f"{r.file}:{r.line}" for r in records])


def read_prompt_data(spec: JobSpec, tokenizer: Any, report) -> tuple[PromptTable, None, None]:
    """grpo's prompts, each with room for its completion (validate refused longer ones), and their records' fields
    for the reward functions; no eval data (validate refuses it)."""
    t_data = time.time()
    table = read_prompt_table(spec.data, tokenizer, max_prompt_tokens=spec.data.seq_len - spec.grpo.max_new_tokens)
    report.event(runlog.DATA, sequences=len(table), examples=len(table), truncated=0, dropped=0, cached=False,
                 seconds=round(time.time() - t_data, 2))
    return table, None, None
