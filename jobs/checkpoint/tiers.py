"""A launch's two checkpoint tiers: the durable one (manager.py) and, with checkpoint.memory_interval_steps, the
memory tier (memory/tier.py); opening the memory tier, and which of the two a start resumes from."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fsdpjob.jobs.checkpoint.memory.tier import MemoryTier
from fsdpjob.orchestrator.core.jobspec.spec import CheckpointSpec
from fsdpjob.orchestrator.core.runfolder import heartbeat, memtier
from fsdpjob.orchestrator.core.runfolder.ckptlayout import step_dir_name
from fsdpjob.orchestrator.core.runfolder.sidecar import Sidecar

from .manager import CheckpointManager


def open_memory_tier(checkpoint: CheckpointSpec, ckpt: CheckpointManager, *, job_id: str | None, restart: int,
                     run_dir: Path, interruptions_per_day: float | None = None) -> MemoryTier | None:
    """The memory tier (checkpoint.memory_interval_steps), keyed by this job and Slurm attempt (``restart``): a
    requeue (a new allocation) resumes from the durable tier. Outside Slurm the run folder stands for the job.
    Collective; None when the spec has no memory tier."""
    if not checkpoint.memory_interval_steps:
        return None
    job = job_id or "run-" + hashlib.sha256(str(run_dir.resolve()).encode()).hexdigest()[:12]
    key = memtier.TierKey(job=job, restart=restart, spec_hash=ckpt.run.spec_hash or "")
    base = memtier.base_for()
    return MemoryTier(base, key, rank=ckpt.rank, world_size=ckpt.world_size,
                      interval_steps=checkpoint.memory_interval_steps, run=ckpt.run,
                      interruptions_per_day=interruptions_per_day)


@dataclass
class Tiers:
    """The launch's tiers, as far as they are open (the memory tier opens after the durable one)."""

    durable: CheckpointManager
    memory: MemoryTier | None = None

    def resumed_at(self, step: int) -> None:
        """This launch goes on from ``step``: the memory tier's newer steps must never be chosen later."""
        if self.memory is not None:
            self.memory.forget_after(step)

    def close(self, *, completed: bool, crashed: bool) -> None:
        """The job's end (``completed``) removes the node's memory tier; a crash leaves it for the next launch's
        resume and waits for nothing."""
        if self.memory is not None:
            self.memory.close(remove=completed, crashed=crashed)
        self.durable.close(crashed=crashed)


@dataclass(frozen=True)
class ResumeSource:
    """Where a start resumes from: a durable step folder, or the memory tier's newest complete step."""

    tier: str  # "durable" or "memory"
    step: int
    load: Callable[[dict[str, Any]], Sidecar]  # (state dict) -> its sidecar; collective
    where: str  # for the resume event
    passed_over: tuple[str, ...] = ()  # newer steps not resumed from, and why (damaged, corrupted): for the event


def find_resume_source(tiers: Tiers, resume_from: str | None) -> ResumeSource | None:
    """The newest step complete across the tiers: the memory tier's when every shard of it is on some node of
    this launch and it is at least as new as the newest durable checkpoint that verifies, else that one."""
    ckpt, tier = tiers.durable, tiers.memory
    durable = find_resume(ckpt, resume_from)
    durable_step = ckpt.step_of(durable) if durable is not None else None
    choice = tier.find() if tier is not None else None
    passed_over = tuple((tier.passed_over if tier is not None else []) + ckpt.passed_over)
    if choice is not None and (durable_step is None or choice.step >= durable_step):
        return ResumeSource("memory", choice.step, lambda state: tier.load(ckpt, choice, state),
                            f"{tier.folder.parent}/<node>/{step_dir_name(choice.step)}", passed_over)
    if durable is None:
        return None
    return ResumeSource("durable", durable_step, lambda state: ckpt.load(durable, state), str(durable), passed_over)


def find_resume(ckpt: CheckpointManager, resume_from: str | None) -> Path | None:
    """The newest committed, verified checkpoint of the run (or --resume-from before the run has one); None on a
    fresh start. The same answer on every rank."""
    heartbeat.enter(heartbeat.CHECKPOINT_LOAD)
    if resume_from and not ckpt.has_committed():
        return ckpt.resume_from(resume_from)
    return ckpt.find_resume(ckpt.run.fingerprint)
