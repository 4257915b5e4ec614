"""Evaluation during preference training: the method's loss and metrics over the eval pairs (or answers), with
their reference, every ``train.eval_every`` steps and at the end; ``eval_loss`` then drives ``keep_best`` as for SFT.

Each rank takes its contiguous share of the eval rows in micro-batches; a rank with fewer micro-batches runs
extra ones over row 0 whose results count nothing, so every rank runs the same number of forwards (FSDP's
gathers, kto's KL all-reduce are collective). The loss is the mean over the eval rows, the metrics the method's
own ratios (jobs/preference/objective.py), logged as ``eval_loss`` and ``eval_<name>`` (``eval_rewards/accuracies``).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from fsdpjob.orchestrator.core.runfolder import heartbeat

from ..report.metrics import Reporter
from ..step import EvalSchedule
from .objective import Objective
from .step import Forward, ReferenceOf, ratios


def eval_rows(total: int, micro_batch_size: int, rank: int, world_size: int) -> list[torch.Tensor | None]:
    """This rank's micro-batches of row indices; None for the extra ones that keep the ranks in step."""
    per_rank = -(-total // world_size)
    count = -(-per_rank // micro_batch_size)
    mine = torch.arange(min(total, rank * per_rank), min(total, (rank + 1) * per_rank))
    batches: list[torch.Tensor | None] = list(mine.split(micro_batch_size))
    return batches + [None] * (count - len(batches))


class PreferenceEvaluator(EvalSchedule):
    """A preference method's evaluation on jobs/step.py EvalSchedule's schedule."""

    def __init__(self, model: torch.nn.Module, table, *, objective: Objective, reference_of: ReferenceOf,
                 forward: Forward, eval_every: int, max_batches: int, micro_batch_size: int, rank: int, world_size: int,
                 device: torch.device, report: Reporter, as_eval: Callable):
        super().__init__(eval_every)
        self.model, self.table, self.objective, self.device = model, table, objective, device
        self.reference_of, self.forward, self.report, self.as_eval = reference_of, forward, report, as_eval
        # train.eval_batches: the first that many micro-batches per rank's worth of rows; 0: every row.
        self.rows = len(table) if not max_batches else min(len(table), max_batches * micro_batch_size * world_size)
        self.batches = eval_rows(self.rows, micro_batch_size, rank, world_size)

    def run(self, step: int) -> float:
        heartbeat.enter(heartbeat.EVAL)
        started = time.time()
        sums = torch.zeros(1 + self.objective.sums, dtype=torch.float32, device=self.device)
        with self.as_eval(self.model):
            for rows in self.batches:
                batch = self.table.micro_batch(rows if rows is not None else torch.zeros(1, dtype=torch.long))
                logps, counts = self.forward(self.model, batch, self.device)
                out = self.objective(logps, counts, self.reference_of(batch), batch)
                kept = 0.0 if rows is None else 1.0
                sums += kept * torch.cat([out.losses.sum().float().reshape(1), out.metric_sums.to(self.device)])
        dist.all_reduce(sums)
        rows = self.rows
        loss = float(sums[0] / max(rows, 1))
        metrics = {f"eval_{name}": value for name, value in ratios(sums, rows, self.objective.metrics).items()}
        self.report.on_eval(step, loss, rows, time.time() - started, extra=metrics)
        self.last = (step, loss)
        return loss
