"""SFT's data: tokenized and packed the same way on every rank (each rank later reads its own slice), cached per
run (jobs/data/cache.py), with the eval rows held out (data.eval_fraction) or read (data.eval_path)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from fsdpjob.orchestrator.core.jobspec.spec import JobSpec
from fsdpjob.orchestrator.core.runfolder import heartbeat, runlog
from fsdpjob.orchestrator.core.runfolder.paths import RunPaths

from ..data.cache import load_or_build
from ..data.packing import SequenceTable
from ..data.sources import build_table, eval_spec
from ..data.stream import split_eval
from ..dist import DistEnv
from ..report.metrics import Reporter


def read_sft_data(spec: JobSpec, paths: RunPaths, env: DistEnv, report: Reporter,
                  tokenizer: Any) -> tuple[SequenceTable, SequenceTable | None, torch.Tensor | None]:
    """The training table, the eval table (or None) and, with eval_fraction, the training rows' places in the
    packed data."""
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    t_data = time.time()

    # Tokenized once per job: rank 0 builds, the ranks that share the run folder read its table (data/cache.py).
    agree = dist.barrier if env.world_size > 1 and dist.is_initialized() else None

    def wait() -> None:
        heartbeat.report(waiting_for="rank 0's tokenized data")
        time.sleep(0.5)

    def packed(data, cache_dir: Path) -> tuple[SequenceTable, bool]:
        return load_or_build(data, spec.model.path, pad_id, cache_dir, is_main=env.is_main,
                             build=lambda: build_table(data, tokenizer, pad_id), agree=agree, wait=wait)

    table, cached = packed(spec.data, paths.cache_dir)
    eval_table, train_rows, extra = None, None, {}
    if spec.data.eval_fraction:
        table, eval_table, train_rows, _ = split_eval(table, spec.data.eval_fraction, spec.train.seed)
    elif spec.data.eval_path is not None:
        # Its own cache folder: a cache folder keeps only its newest table.
        eval_table, _ = packed(eval_spec(spec.data), paths.cache_dir / "eval")
    if eval_table is not None:
        extra = {"eval_sequences": len(eval_table)}
    report.event(runlog.DATA, sequences=len(table), examples=table.num_examples, truncated=table.truncated,
                 split=table.split, dropped=table.dropped, packing_efficiency=round(table.efficiency, 4),
                 cached=cached, seconds=round(time.time() - t_data, 2), **extra)
    return table, eval_table, train_rows
