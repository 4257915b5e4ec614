"""When the training loop saves and stops: intervals, stop signals, the last-step rule, and the stop path."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from fsdpjob.orchestrator.core import heartbeat, runlog
from fsdpjob.orchestrator.core.spec import JobSpec

from . import preemption
from .agreement import FlagAgreement
from .checkpoint.manager import CheckpointManager
from .hooks import TestHooks
from .metrics import Reporter
from .workerenv import WorkerEnv

log = logging.getLogger("fsdpjob.train")


@dataclass(frozen=True)
class SavePolicy:
    """Which steps get a checkpoint; pure, so every rank that sees the same inputs decides the same."""

    interval_steps: int  # 0: none by step count
    interval_minutes: float  # 0: none by time
    max_steps: int

    def time_due(self, seconds_since_save: float) -> bool:
        return bool(self.interval_minutes) and seconds_since_save >= self.interval_minutes * 60

    def reason(self, step: int, *, signum: int, time_due: bool) -> str | None:
        """Why to save after ``step`` ("stop" or "interval"), or None. The last step's save is the final one."""
        if signum:
            # After the last step the final save ends the job sooner than a requeue would.
            return None if step >= self.max_steps else "stop"
        n = self.interval_steps
        if time_due or (n and step % n == 0 and step < self.max_steps):
            return "interval"
        return None


class Checkpointer:
    """Saves when the policy says so and leads a stop to its requeue; every method runs on all ranks."""

    def __init__(self, ckpt: CheckpointManager, spec: JobSpec, *, stop: preemption.StopFlag,
                 control: dist.ProcessGroup | None, report: Reporter, worker: WorkerEnv, hooks: TestHooks,
                 eval_loss_at: Callable[[int], float | None] | None = None) -> None:
        self.ckpt, self.stop, self.control, self.report = ckpt, stop, control, report
        self.worker, self.hooks = worker, hooks
        self.eval_loss_at = eval_loss_at  # a step's eval loss, recorded in its checkpoint's sidecar (keep_best)
        self.policy = SavePolicy(spec.checkpoint.interval_steps, spec.checkpoint.interval_minutes, spec.train.max_steps)
        self.max_requeues = spec.preemption.max_requeues
        self._last_save = time.time()  # the interval in minutes counts from the start of training
        self._save_started = self._last_save
        # The stop signal and rank 0's "a time-based save is due" reach every rank in an all-gather that
        # travels while a step trains, every few steps (jobs/agreement.py); the stop-at-step test hook's step
        # always carries one, so its stop lands on that step.
        self.agreement = FlagAgreement(2, control, always_at=[hooks.stop_at_step] if hooks.stop_at_step else [])

    def before_step(self, step: int) -> None:
        """Before ``step`` trains, on every rank: where that step carries an agreement, start it with this
        rank's stop signal and (rank 0 only) whether a time-based save is due. A signal that arrives after
        that waits for the next agreement and the step carrying it (orchestrator/core/stopping.py bounds the
        wait; the planner's signal-lead check counts it)."""
        if not self.agreement.carries(step):
            return
        if self.hooks.stop_at_step == step and dist.get_rank() == 0:
            self.stop.request()
        due = dist.get_rank() == 0 and self.policy.time_due(time.time() - self._last_save)
        self.agreement.begin(step, (self.stop.signum, int(due)))

    def after_step(self, step: int, state: dict[str, Any]) -> int:
        """After ``step`` trained, on every rank, with the flags agreed for it (none on a step that carried
        no agreement): save if due. Returns the stop signal once its checkpoint is committed, else 0."""
        signum, time_due = self.agreement.end(step)
        reason = self.policy.reason(step, signum=signum, time_due=bool(time_due))
        if signum and reason is None:
            log.info("stop signal %d after the last step: finishing instead of requeueing", signum)
        if reason is None:
            return 0
        self._save(step, state, reason)
        return signum

    def save_final(self, step: int, state: dict[str, Any]) -> None:
        self._save(step, state, "final")

    def _save(self, step: int, state: dict[str, Any], reason: str) -> None:
        heartbeat.enter(heartbeat.SAVE)
        started = time.time()
        eval_loss = self.eval_loss_at(step) if self.eval_loss_at else None
        saved = self.ckpt.save(step, state, reason=reason, eval_loss=eval_loss)
        self._last_save = time.time()
        if reason != "interval":
            self.ckpt.wait()  # committed on every rank before anyone requeues or reports done
        self._save_started = started
        if saved:
            self.report.event(runlog.CHECKPOINT, step=step, reason=reason, save_s=round(time.time() - started, 3))

    def stop_and_requeue(self, signum: int, step: int) -> NoReturn:
        """After the stop checkpoint committed: rank 0 requeues (unless the job was cancelled) and reports; every
        rank then leaves without a result, the same way."""
        outcome = preemption.REQUEUED
        if dist.get_rank() == 0:
            kind = preemption.classify_stop(self.worker)
            signal_to_commit = time.time() - (self.stop.received_at or self._save_started)
            outcome, detail = preemption.requeue(self.max_requeues, self.worker)
            kind = "cancelled" if outcome == preemption.CANCELLED else kind
            self.report.event(runlog.STOP, reason=kind, signal=signum, step=step,
                              requeued=outcome == preemption.REQUEUED, detail=detail,
                              save_s=round(time.time() - self._save_started, 3),
                              signal_to_commit_s=round(signal_to_commit, 3))
            if outcome == preemption.NOT_REQUEUED:
                self.report.event(runlog.FAILED, reason=detail, step=step, retryable=False)
        flag = torch.tensor([outcome], dtype=torch.int32)
        dist.broadcast(flag, src=0, group=self.control)  # every rank exits the same way
        preemption.exit_after_stop(int(flag.item()), self.worker)
