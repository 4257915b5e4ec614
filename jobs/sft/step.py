"""SFT's step and evaluator over the run's parts, made once at set-up (jobs/methods.py's sft row)."""

from __future__ import annotations

from collections.abc import Callable

from fsdpjob.orchestrator.core.jobspec.spec import JobSpec

from ..data.packing import StepBatch
from ..dist import DistEnv
from ..report.metrics import Reporter
from ..step import StepValues, train_step
from .evaluate import Evaluator


def sft_step(spec: JobSpec, parts, env: DistEnv, *, defer_grad_sync: bool,
             chunk_tokens: int) -> Callable[[StepBatch], StepValues]:
    """One optimizer step over this rank's micro-batches: the token-mean cross-entropy (chunked: ``chunk_tokens``,
    jobs/step.py loss_chunk_tokens)."""
    return lambda batch: train_step(parts.model, parts.optimizer, batch.micro_batches, env.device,
                                    tokens=batch.tokens, max_grad_norm=spec.train.max_grad_norm,
                                    defer_grad_sync=defer_grad_sync, processed=batch.processed,
                                    chunk_tokens=chunk_tokens)


def sft_evaluator(spec: JobSpec, parts, env: DistEnv, report: Reporter, chunk_tokens: int) -> Evaluator:
    """The eval loss over parts.eval_table, evaluated the way the step trains (chunked or not)."""
    return Evaluator(parts.model, parts.eval_table, eval_every=spec.train.eval_every,
                     max_batches=spec.train.eval_batches, micro_batch_size=spec.train.micro_batch_size,
                     rank=env.rank, world_size=env.world_size, device=env.device, report=report,
                     chunk_tokens=chunk_tokens)
