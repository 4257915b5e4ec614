"""SFT's evaluation during training: the eval loss (jobs/step.py eval_loss) on jobs/step.py EvalSchedule's steps,
and its log line."""

from __future__ import annotations

import time

import torch

from fsdpjob.orchestrator.core.runfolder import heartbeat

from ..data.packing import SequenceTable
from ..data.stream import eval_batches
from ..report.metrics import Reporter
from ..step import EvalSchedule, eval_loss


class Evaluator(EvalSchedule):
    """SFT's evaluation: the token-mean loss over the eval micro-batches, made once (the same rows every time)."""

    def __init__(self, model: torch.nn.Module, table: SequenceTable, *, eval_every: int, max_batches: int,
                 micro_batch_size: int, rank: int, world_size: int, device: torch.device, report: Reporter,
                 chunk_tokens: int = 0):
        super().__init__(eval_every)
        self.model, self.device, self.report = model, device, report
        self.chunk_tokens = chunk_tokens  # the training step's loss (train.loss): chunked evaluates chunked
        self.batches = eval_batches(table, micro_batch_size=micro_batch_size, max_batches=max_batches,
                                    dp_rank=rank, dp_world=world_size)

    def run(self, step: int) -> float:
        heartbeat.enter(heartbeat.EVAL)
        started = time.time()
        loss, tokens = eval_loss(self.model, self.batches, self.device, chunk_tokens=self.chunk_tokens)
        self.report.on_eval(step, loss, tokens, time.time() - started)
        self.last = (step, loss)
        return loss
