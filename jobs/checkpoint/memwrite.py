"""The memory tier's snapshot: each rank's part of the checkpoint written as plain DCP into the node's folder,
through the same async staging as the durable tier (checkpoint/staging.py), so the loop waits only for what the
next step's forward and backward do not overlap. The commit runs in the tier's own thread on its gloo group: rank
0's ``.metadata`` and sidecar go to every node, the replicas to the buddies (memreplicate.py), each rank records
its part, and once every rank's part is complete ``COMMITTED`` is written on every node. Any failure turns the tier
off for the rest of the launch with a warning (shared memory full: ENOSPC); the durable tier is unchanged."""

from __future__ import annotations

import json
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from fsdpjob.orchestrator.core.fileio import write_atomic
from fsdpjob.orchestrator.core.runfolder.ckptlayout import MARKER, step_dir_name, step_dirs
from fsdpjob.orchestrator.core.runfolder.memtier import (
    METADATA,
    TierKey,
    marker_text,
    part_name,
    remove_step,
    shard_name,
)
from fsdpjob.orchestrator.core.runfolder.sidecar import RunFacts, Sidecar

from .io import CheckpointWriter
from .manager import save_facts
from .memnode import TierNode, write_to_shm
from .memreplicate import replicate
from .staging import StagingGate, stage_in_background, start_async_save

log = logging.getLogger("fsdpjob.checkpoint")


def _part_text(step: int, key: TierKey, rank: int, files: dict[str, int]) -> str:
    return json.dumps({"step": step, **asdict(key), "rank": rank, "files": files}) + "\n"


class SnapshotWriter:
    """Starts a snapshot (collective) and commits it in the background; at most one in flight."""

    def __init__(self, node: TierNode, run: RunFacts) -> None:
        self.node, self.run = node, run
        self._stager = stage_in_background(torch.cuda.is_available())
        self._committer = ThreadPoolExecutor(1, thread_name_prefix="memory-tier")
        self._pending: Future | None = None
        self._gate: StagingGate | None = None
        self.waited_s = 0.0  # the loop's time in save() and in the optimizer's wait for the copy (the bench reads it)

    def save(self, step: int, state: dict[str, Any]) -> None:
        """Start the snapshot of ``step`` (the previous one is finished first); returns once it is staged."""
        started = time.monotonic()
        node = self.node
        self.wait()
        if not node.enabled:
            return
        step_dir = node.folder / step_dir_name(step)
        try:
            if node.first_on_node and step_dir.exists():
                remove_step(step_dir)
            node.barrier()
            step_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            node.off(f"cannot create {step_dir} ({exc})")
        if not node.agree_enabled():
            return
        facts = save_facts(step, state, reason="memory", eval_loss=None, world_size=node.world_size, run=self.run)
        future, self._gate = start_async_save(
            state, storage_writer=CheckpointWriter(str(step_dir)), async_stager=self._stager,
            process_group=node.pg, no_dist=node.pg is None)
        self._pending = self._committer.submit(self._commit, step, step_dir, facts, future, started)
        self.waited_s += time.monotonic() - started

    @property
    def stalled_s(self) -> float:
        """waited_s with the wait of the copy in flight, which wait() adds only later: the copy's wait is known as
        soon as the next optimizer step went through the gate, before its commit is over."""
        return self.waited_s + (self._gate.waited_s if self._gate is not None else 0.0)

    def wait(self) -> None:
        """Finish the snapshot in flight (its commit included)."""
        if self._pending is None:
            return
        pending, self._pending = self._pending, None
        try:
            pending.result()
        finally:
            if self._gate is not None:
                self.waited_s += self._gate.waited_s
                self._gate.release()
                self._gate = None

    def close(self, *, crashed: bool) -> None:
        """Stop the commit thread (after a crash without waiting: a peer may be gone) and free the buffers."""
        self._committer.shutdown(wait=not crashed, cancel_futures=True)
        self._stager.close()

    def _commit(self, step: int, step_dir: Path, facts: Sidecar, future: Future, started: float) -> None:
        """In the tier's thread, on every rank: the write's end, the replicas, the parts, the markers."""
        node = self.node
        ok = True
        try:
            future.result()  # DCP's last collective: every rank's shard is written, rank 0's .metadata too
        # DCP raises its CheckpointException (a BaseException) for a rank's failed write, ENOSPC included.
        except (Exception, CheckpointException) as exc:  # a failed snapshot turns the tier off, never the run
            ok = node.failed(f"snapshot of step {step} failed ({type(exc).__name__}: {exc})")
        ok, files = self._write_shared(step, step_dir, facts, started, ok)
        files.update(replicate(node, step_dir, ok))
        try:
            if ok:
                write_atomic(step_dir / part_name(node.rank), _part_text(step, node.key, node.rank, files))
        except OSError as exc:
            ok = node.failed(f"step {step}: cannot record this rank's part ({exc})")
        if not node.all(ok):
            node.enabled = False
            if node.first_on_node:
                remove_step(step_dir)
            log.warning("memory tier off for the rest of this launch: step %d is incomplete on some rank; "
                        "a restart resumes from the durable checkpoints", step)
            return
        if node.first_on_node:
            write_atomic(step_dir / MARKER, marker_text(step, node.key, node.world_size, node.hosts))
        node.barrier()  # committed on every node before any node drops its older step
        if node.first_on_node:
            for older, older_dir in step_dirs(node.folder):
                if older < step:
                    remove_step(older_dir)
        log.info("memory tier: step %d committed on %s (%.2f s)", step, node.node, time.monotonic() - started)

    def _write_shared(self, step: int, step_dir: Path, facts: Sidecar, started: float,
                      ok: bool) -> tuple[bool, dict[str, int]]:
        """Rank 0's .metadata and sidecar onto every node (collective); whether all is well still, and this rank's
        own shard's size."""
        node = self.node
        shared: list[Any] = [None]
        if node.rank == 0 and ok:
            sidecar = replace(facts, wall_time=time.time(), save_seconds=round(time.monotonic() - started, 3))
            shared[0] = ((step_dir / METADATA).read_bytes(), sidecar)
        if node.pg is not None:
            dist.broadcast_object_list(shared, src=0, group=node.pg)
        ok = ok and shared[0] is not None
        files: dict[str, int] = {}
        try:
            if ok and node.first_on_node:
                metadata, sidecar = shared[0]
                if node.rank != 0:
                    write_to_shm(step_dir / METADATA, metadata)
                sidecar.write(step_dir)
            own = step_dir / shard_name(node.rank)
            if ok:
                files[own.name] = own.stat().st_size
        except OSError as exc:
            ok = node.failed(f"step {step}: {exc}")
        return ok, files
