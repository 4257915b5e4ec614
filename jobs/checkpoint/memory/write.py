"""The memory tier's snapshot: each rank's part of the checkpoint copied from the live state straight into its file
in the node's folder (memory/raw.py: DCP's metadata over raw bytes, DCP's plan made once per launch), in the tier's copy
thread, so the loop waits only for what the next step's forward and backward do not overlap (the optimizer's step
waits at the staging gate, checkpoint/staging.py). The commit runs in the tier's own thread on its gloo group: every
rank's pickled entries' places and rank 0's sidecar to every rank, the ``.metadata`` and sidecar onto every node, the
replicas to the buddies (memory/replicate.py, from the file's pages), each rank records its part, and once every rank's
part is complete ``COMMITTED`` is written on every node. Any failure turns the tier off for the rest of the launch
with a warning (shared memory full: ENOSPC, at the file's allocation); the durable tier is unchanged."""

from __future__ import annotations

import json
import logging
import pickle
import time
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.api import CheckpointException

from fsdpjob.jobs.checkpoint.manager import save_facts
from fsdpjob.jobs.checkpoint.staging import StagingGate, bind_cuda_device
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

from .node import TierNode, write_to_shm
from .raw import Filled, Layout, fill, metadata_with, plan_layout, take
from .replicate import replicate

log = logging.getLogger("fsdpjob.checkpoint")

REPLAY, PLAN, OFF = 2, 1, 0  # what the ranks agree a snapshot does: the launch's plan, a new plan, nothing


def _part_text(step: int, key: TierKey, rank: int, files: dict[str, int], sums: dict[str, int]) -> str:
    """A rank's part: the files it wrote on its node, their sizes and (``crc32``) the sums their writer took of
    them, which a resume checks before it reads them (memtier.holding_of)."""
    crc32 = {name: sums[name] for name in files if name in sums}
    return json.dumps({"step": step, **asdict(key), "rank": rank, "files": files, "crc32": crc32}) + "\n"


class SnapshotWriter:
    """Starts a snapshot (collective) and commits it in the background; at most one in flight."""

    def __init__(self, node: TierNode, run: RunFacts) -> None:
        self.node, self.run = node, run
        device = torch.cuda.current_device() if torch.cuda.is_available() else None
        self._copier = ThreadPoolExecutor(1, thread_name_prefix="memory-tier-copy", initializer=bind_cuda_device,
                                          initargs=(device,))
        self._committer = ThreadPoolExecutor(1, thread_name_prefix="memory-tier")
        self._layout: Layout | None = None
        self._pending: Future | None = None
        self._gate: StagingGate | None = None
        self.waited_s = 0.0  # the loop's time in save() and in the optimizer's wait for the copy (the bench reads it)

    def save(self, step: int, state: dict[str, Any]) -> None:
        """Start the snapshot of ``step`` (the previous one is finished first); returns once its sources are taken."""
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
        sources = take(self._layout, state) if node.enabled and self._layout is not None else None
        how = node.least(OFF if not node.enabled else REPLAY if sources is not None else PLAN)
        if how == OFF:
            node.enabled = False
            return
        if how == PLAN:  # the launch's first snapshot, or the state's shape changed on some rank
            try:
                self._layout = plan_layout(node, state)
            except (Exception, CheckpointException) as exc:  # raised on every rank: DCP's save gathers failures
                node.off(f"cannot plan the snapshot of step {step} ({type(exc).__name__}: {exc})")
                return
            sources = take(self._layout, state)
            assert sources is not None, "a state that does not match the plan just made from it"
        facts = save_facts(step, state, reason="memory", eval_loss=None, world_size=node.world_size, run=self.run)
        name = self._layout.name
        copied = self._copier.submit(fill, step_dir / name, self._layout, sources, node.spare / name)
        self._gate = StagingGate(state, copied)
        self._pending = self._committer.submit(self._commit, step, step_dir, facts, copied, started)
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
        """Stop the copy and commit threads (after a crash without waiting: a peer may be gone)."""
        self._committer.shutdown(wait=not crashed, cancel_futures=True)
        self._copier.shutdown(wait=not crashed, cancel_futures=True)

    def _commit(self, step: int, step_dir: Path, facts: Sidecar, copied: Future, started: float) -> None:
        """In the tier's thread, on every rank: the copy's end, the shared files, the replicas, the parts, the
        markers."""
        node = self.node
        filled: Filled | None = None
        try:
            filled = copied.result()
        except Exception as exc:  # a failed snapshot turns the tier off, never the run
            log.warning("memory tier on %s: snapshot of step %d failed (%s: %s)", node.node, step,
                        type(exc).__name__, exc)
        try:
            ok, files, sums = self._write_shared(step, step_dir, facts, started, filled)
            files.update(replicate(node, step_dir, filled.data if ok and filled is not None else None))
        finally:
            if filled is not None:
                filled.data = None  # unmapped: the pages are the file's (an older step's go with its folder)
        try:
            if ok:
                write_atomic(step_dir / part_name(node.rank), _part_text(step, node.key, node.rank, files, sums))
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
        older = [older_dir for older, older_dir in step_dirs(node.folder) if older < step]
        for older_dir in older:
            node.keep_spares(older_dir)
        node.barrier()  # every rank's files moved before the folders go
        if node.first_on_node:
            for older_dir in older:
                remove_step(older_dir)
        log.info("memory tier: step %d committed on %s (%.2f s)", step, node.node, time.monotonic() - started)

    def _write_shared(self, step: int, step_dir: Path, facts: Sidecar, started: float,
                      filled: Filled | None) -> tuple[bool, dict[str, int], dict[str, int]]:
        """Every rank's pickled entries' places, the CRC32 of its file and rank 0's sidecar to every rank
        (collective), the ``.metadata`` and sidecar onto every node; whether every rank's copy went well, this
        rank's own file's size, and every rank's file's sum (a replica's part records its source's)."""
        node = self.node
        sidecar = None
        if node.rank == 0:
            sidecar = replace(facts, wall_time=time.time(), save_seconds=round(time.monotonic() - started, 3))
        # Summed here, in the commit's thread, from the pages just filled: the copy (which the loop may wait for)
        # is over, and zlib releases the GIL.
        crc = None if filled is None or filled.data is None else zlib.crc32(filled.data.numpy())
        everyone = node.gather((None if filled is None else filled.blobs, sidecar, crc))
        if filled is None or any(blobs is None for blobs, _, _ in everyone):
            return False, {}, {}
        assert self._layout is not None
        sums = {shard_name(rank): crc for rank, (_, _, crc) in enumerate(everyone) if crc is not None}
        try:
            if node.first_on_node:
                metadata = metadata_with(self._layout, [blobs for blobs, _, _ in everyone])
                write_to_shm(step_dir / METADATA, pickle.dumps(metadata))
                everyone[0][1].write(step_dir)
        except OSError as exc:
            return node.failed(f"step {step}: {exc}"), {}, {}
        return True, {self._layout.name: filled.data.numel()}, sums
