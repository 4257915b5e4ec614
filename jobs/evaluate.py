"""Evaluation during training: which steps evaluate, the eval loss (jobs/step.py eval_loss), and its log line."""

from __future__ import annotations

import time

import torch

from fsdpjob.orchestrator.core.runfolder import heartbeat

from .data.packing import SequenceTable
from .data.stream import eval_batches
from .metrics import Reporter
from .step import eval_loss


class EvalSchedule:
    """Evaluates at every ``eval_every`` steps and at the end; every method runs on all ranks. A subclass's
    ``run(step)`` evaluates, records ``last`` and returns the eval loss (SFT's below; preference/evaluate.py's).

    The schedule depends on the step alone, so a resumed or resharded run evaluates at the same steps.
    """

    def __init__(self, eval_every: int):
        self.eval_every = eval_every
        self.last: tuple[int, float] | None = None  # (step, eval loss) of the latest evaluation of this start

    def run(self, step: int) -> float:
        raise NotImplementedError

    def maybe_run(self, step: int) -> None:
        if step % self.eval_every == 0:
            self.run(step)

    def run_final(self, step: int, start_step: int) -> None:
        """After the last step: evaluate unless this start trained no step or already evaluated this one."""
        if step > start_step and (self.last is None or self.last[0] != step):
            self.run(step)

    def loss_at(self, step: int) -> float | None:
        """The eval loss of ``step`` when this start evaluated it (what a checkpoint of that step records)."""
        return self.last[1] if self.last is not None and self.last[0] == step else None


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
