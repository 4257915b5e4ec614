"""A preference method's data: a pair (or a labelled answer) per row, both answers right-padded to seq_len: not
packed, not cached (the tokenizing is a small part of a preference job's set-up beside its reference pass).
data.eval_fraction holds whole rows out (a pair's two answers together); kto's KL partners are drawn after, within
each side. Which reader, options and partners a method takes is its row's (jobs/methods.py)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from fsdpjob.orchestrator.core.jobspec.spec import JobSpec
from fsdpjob.orchestrator.core.runfolder import runlog

from ..data.pairtable import pad_id_of
from ..data.stream import split_eval
from ..report.metrics import Reporter
from .ktobatch import KtoTable


def read_preference_data(spec: JobSpec, tokenizer, report: Reporter, *, read: Callable[..., Any],
                         options: dict[str, Any] | None = None,
                         kl_partners: bool = False) -> tuple[Any, Any, torch.Tensor | None]:
    """``read`` (data/preference.py's pair or unpaired reader, given ``options``) over data.path and the eval
    data; ``kl_partners``: each answer with its mismatched KL row (kto; its partner fixed by the seed)."""
    t_data = time.time()
    options = options or {}
    table = read(spec.data, tokenizer, **options)
    eval_table, train_rows = None, None
    if spec.data.eval_fraction:
        table, eval_table, train_rows, _ = split_eval(table, spec.data.eval_fraction, spec.train.seed)
    elif spec.data.eval_path:
        eval_table = read(spec.data, tokenizer, path=spec.data.eval_path, **options)
    if kl_partners:
        table = KtoTable.of(table, spec.train.seed, pad_id_of(tokenizer))
        eval_table = KtoTable.of(eval_table, spec.train.seed, pad_id_of(tokenizer)) if eval_table else None
    report.event(runlog.DATA, sequences=len(table), examples=table.num_examples, truncated=table.truncated,
                 dropped=table.dropped, cached=False, seconds=round(time.time() - t_data, 2),
                 **({"eval_sequences": len(eval_table)} if eval_table is not None else {}))
    return table, eval_table, train_rows
