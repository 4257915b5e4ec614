"""The saver: when the training loop saves to either tier (the memory tier's snapshot, the durable tier's intervals,
the stop signal's save, the last-step rule), taking the saves and reporting them. What happens after a stop's
checkpoint (classify, requeue, exit) is preemption.py's."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch.distributed as dist

from fsdpjob.orchestrator.core.jobspec.spec import CheckpointSpec
from fsdpjob.orchestrator.core.runfolder import heartbeat, runlog

from . import preemption
from .agreement import FlagAgreement
from .checkpoint.tiers import Tiers
from .hooks import TestHooks
from .report.metrics import Reporter

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
    """Saves to both tiers when they say so (the memory tier its schedule, the durable tier the policy, the stop's
    checkpoint included); every method runs on all ranks."""

    def __init__(self, tiers: Tiers, checkpoint: CheckpointSpec, *, max_steps: int,
                 stop: preemption.StopFlag, control: dist.ProcessGroup | None, report: Reporter, hooks: TestHooks,
                 eval_loss_at: Callable[[int], float | None] | None = None) -> None:
        self.ckpt, self.memory = tiers.durable, tiers.memory
        self.stop, self.control, self.report, self.hooks = stop, control, report, hooks
        self.eval_loss_at = eval_loss_at  # a step's eval loss, recorded in its checkpoint's sidecar (keep_best)
        self.policy = SavePolicy(checkpoint.interval_steps, checkpoint.interval_minutes, max_steps)
        self._last_save = time.time()  # the interval in minutes counts from the start of training
        self.save_started = self._last_save  # when the newest save began (the stop event's save_s)
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
        """After ``step`` trained, on every rank: the memory tier's snapshot if due, then, with the flags agreed
        for the step (none on a step that carried no agreement), the durable save if due. Returns the stop signal
        once its checkpoint is committed, else 0."""
        self._snapshot(step, state)
        self.hooks.maybe_exit(step)  # the crash test hook: the snapshot started, the durable save not
        signum, time_due = self.agreement.end(step)
        if staged := self.ckpt.staging_wait():  # an async save's copy: what it still cost the loop
            self.report.event(runlog.STAGED, step=staged[0], waited_s=round(staged[1], 4))
        reason = self.policy.reason(step, signum=signum, time_due=bool(time_due))
        if signum and reason is None:
            log.info("stop signal %d after the last step: finishing instead of requeueing", signum)
        if reason is None:
            return 0
        self._save(step, state, reason)
        return signum

    def _snapshot(self, step: int, state: dict[str, Any]) -> None:
        tier = self.memory
        if tier is None:
            return
        if tier.due(step, self.policy.max_steps):
            tier.save(step, state)
        if choice := tier.take_auto_choice():  # once per launch, with memory_interval_steps: auto
            self.report.event(runlog.MEMORY_TIER, at_step=step, **asdict(choice))

    def save_final(self, step: int, state: dict[str, Any]) -> None:
        """The end of training's save (none with the skip-final-save test hook)."""
        if not self.hooks.skip_final_save:
            self._save(step, state, "final")

    def _save(self, step: int, state: dict[str, Any], reason: str) -> None:
        heartbeat.enter(heartbeat.SAVE)
        started = time.time()
        eval_loss = self.eval_loss_at(step) if self.eval_loss_at else None
        saved = self.ckpt.save(step, state, reason=reason, eval_loss=eval_loss)
        self._last_save = time.time()
        if reason != "interval":
            self.ckpt.wait()  # committed on every rank before anyone requeues or reports done
        self.save_started = started
        if saved:
            self.report.event(runlog.CHECKPOINT, step=step, reason=reason, save_s=round(time.time() - started, 3))
