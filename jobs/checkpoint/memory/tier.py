"""The memory tier: every few steps each rank's part of the checkpoint goes into node-local shared memory (files
under /dev/shm that outlive the worker process), with a replica on a rank of another node, so a restart in the
same allocation resumes from a few steps back instead of from the last durable checkpoint.

This module is the tier's face to the saver and the resume, and its clean-up (leftovers at the start, steps a
resume made obsolete, the node's folder at the job's end). Its parts, beside it in jobs/checkpoint/memory/: the node
folder and group (node.py), when to snapshot (schedule.py), the file format (raw.py), the snapshot and its commit
(write.py), the replicas (replicate.py) and the resume's read (read.py). Layout and the choice of a step:
orchestrator/core/runfolder/memtier.py.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from fsdpjob.jobs.checkpoint.manager import CheckpointManager
from fsdpjob.orchestrator.core.runfolder.ckptlayout import step_dirs
from fsdpjob.orchestrator.core.runfolder.memtier import (
    AutoInterval,
    TierChoice,
    TierKey,
    mtbi_s,
    remove_step,
    scan_node,
)
from fsdpjob.orchestrator.core.runfolder.sidecar import RunFacts, Sidecar

from . import read
from .node import TierNode
from .schedule import MemorySchedule
from .write import SnapshotWriter


class MemoryTier:
    """Snapshots into ``<base>/<job>/<node>/`` every ``interval_steps`` steps; every method is collective.

    ``interval_steps`` "auto": a warm-up snapshot PROBE_STEPS steps into the launch (it pays the launch's plan and
    new files: not measured), the probe snapshot PROBE_STEPS steps later, and PROBE_STEPS steps after it the
    interval from what the probe cost and the job's mean time between faults (``interruptions_per_day`` per node,
    the profile's rate; core/memtier.auto_interval), agreed by all ranks."""

    def __init__(self, base: str | Path, key: TierKey, *, rank: int, world_size: int, interval_steps: int | str,
                 run: RunFacts, interruptions_per_day: float | None = None) -> None:
        self.node = TierNode(base, key, rank=rank, world_size=world_size)
        self.writer = SnapshotWriter(self.node, run)
        self.schedule = MemorySchedule(interval_steps, mtbi_s=mtbi_s(interruptions_per_day, len(set(self.node.hosts))),
                                       rank=rank, slowest=self._slowest)
        self.passed_over: list[str] = []  # why find() passed newer steps or files over (corrupted, incomplete)
        self._remove_leftovers()
        self.node.agree_enabled()

    @property
    def folder(self) -> Path:
        """This node's folder of the tier."""
        return self.node.folder

    @property
    def waited_s(self) -> float:
        """The loop's time in save() and in the optimizer's wait for the copy (bench/memory_tier.py reads it)."""
        return self.writer.waited_s

    # -- save ------------------------------------------------------------------------------------

    def due(self, step: int, max_steps: int) -> bool:
        """Whether to snapshot after ``step``; called after every step (auto measures between the calls)."""
        return self.node.enabled and self.schedule.due(step, max_steps, waited_s=self.writer.stalled_s)

    def take_auto_choice(self) -> AutoInterval | None:
        return self.schedule.take_auto_choice()

    def save(self, step: int, state: dict[str, Any]) -> None:
        """Start the snapshot of ``step`` (the previous one is finished first); returns once it is staged."""
        self.schedule.saved(step)
        self.writer.save(step, state)

    def wait(self) -> None:
        """Finish the snapshot in flight (its commit included)."""
        self.writer.wait()

    def _slowest(self, figures: list[float]) -> list[float]:
        # The snapshot's commit runs collectives on the tier's group in the tier's thread: it must be over before
        # this thread runs one there.
        self.writer.wait()
        return self.node.slowest(figures)

    # -- resume ----------------------------------------------------------------------------------

    def find(self) -> TierChoice | None:
        """The newest step the nodes of this launch hold in full (same answer on every rank), if any; why newer
        steps were passed over goes to ``passed_over``."""
        choice, self.passed_over = read.find(self.node)
        return choice

    def load(self, ckpt: CheckpointManager, choice: TierChoice, state: dict[str, Any]) -> Sidecar:
        """Load ``state`` from the tier's step ``choice.step`` through the durable manager's load."""
        return read.load(self.node, ckpt, choice, state)

    # -- clean-up --------------------------------------------------------------------------------

    def _remove_leftovers(self) -> None:
        """Leftovers of a save cut short and of another attempt of this job are never resumed from."""
        node = self.node
        try:
            node.folder.mkdir(parents=True, exist_ok=True)
            if node.first_on_node:
                shutil.rmtree(node.spare, ignore_errors=True)  # another launch's: of another size, perhaps
                held = {h.step for h in scan_node(node.folder, node.key)}
                for step, step_dir in step_dirs(node.folder):
                    if step not in held:
                        remove_step(step_dir)
        except OSError as exc:
            node.off(f"cannot use {node.folder} ({exc})")

    def forget_after(self, step: int) -> None:
        """Drop this job's tier steps newer than ``step``, the one this launch resumed from: training goes on from
        there, so they must never be chosen later."""
        if self.node.first_on_node:
            for newer, step_dir in step_dirs(self.node.folder):
                if newer > step:
                    remove_step(step_dir)
        self.node.barrier()

    def close(self, *, remove: bool, crashed: bool = False) -> None:
        """Stop the tier's threads and free the group; ``remove`` (the job completed): delete this node's tier. After a
        crash nothing is waited for (a peer may be gone) and the tier stays for the next launch."""
        try:
            if not crashed:
                self.writer.wait()
        finally:
            self.writer.close(crashed=crashed)
            if remove and self.node.first_on_node:
                shutil.rmtree(self.node.folder, ignore_errors=True)
                try:
                    self.node.folder.parent.rmdir()  # the job's folder, once its last node folder on this host is gone
                except OSError:
                    pass
            self.node.close_group(crashed=crashed)
