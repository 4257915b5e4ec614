"""The memory tier: every few steps each rank's part of the checkpoint goes into node-local shared memory (files
under /dev/shm that outlive the worker process), with a replica on a rank of another node, so a restart in the
same allocation resumes from a few steps back instead of from the last durable checkpoint.

The files are plain DCP, written through the same async staging as the durable tier (checkpoint/staging.py): the
loop waits only for what the next step's forward and backward do not overlap. What happens after the write runs
in this tier's own thread, on its own gloo group (never the compute stream): rank 0's ``.metadata`` and sidecar
go to every node, each rank's shard goes to its buddy on the next node, each rank records its part, and once all
ranks agree that every part is complete, ``COMMITTED`` is written on every node (layout and decision:
orchestrator/core/memtier.py).

A resume reads the newest step the surviving nodes hold in full, on any world size: DCP's load plan says which
items each rank needs, and the bytes of those that its own node lacks come over gloo from a rank whose node has
them (into a sparse per-rank copy that DCP then reads as usual). Any failure of a save here (shared memory full:
ENOSPC) turns the tier off for the rest of the launch with a warning; the durable tier is unchanged.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from fsdpjob.orchestrator.core.ckptlayout import MARKER, SIDECAR, step_dir_name, step_dirs
from fsdpjob.orchestrator.core.fileio import write_atomic
from fsdpjob.orchestrator.core.memtier import (
    AUTO,
    METADATA,
    PROBE_STEPS,
    AutoInterval,
    TierChoice,
    TierKey,
    auto_interval,
    buddies,
    choose_step,
    marker_text,
    mtbi_s,
    node_dir,
    node_name,
    part_name,
    remove_step,
    scan_node,
    shard_name,
)
from fsdpjob.orchestrator.core.sidecar import RunFacts, Sidecar

from .io import CheckpointReader, CheckpointWriter
from .manager import CheckpointManager, save_facts
from .staging import StagingGate, stage_in_background, start_async_save

log = logging.getLogger("fsdpjob.checkpoint")


def _write_bytes(path: Path, data: bytes | memoryview) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


class MemoryTier:
    """Snapshots into ``<base>/<job>/<node>/`` every ``interval_steps`` steps; every method is collective.

    ``interval_steps`` "auto": the first snapshot PROBE_STEPS steps into the launch, and PROBE_STEPS steps later
    the interval from what it cost and the job's mean time between faults (``interruptions_per_day`` per node, the
    profile's rate; core/memtier.auto_interval), agreed by all ranks.
    The constructor creates the tier's gloo group and learns every rank's node (for the buddies)."""

    def __init__(self, base: str | Path, key: TierKey, *, rank: int, world_size: int, interval_steps: int | str,
                 run: RunFacts, interruptions_per_day: float | None = None) -> None:
        self.key, self.rank, self.world_size, self.run = key, rank, world_size, run
        self.auto = interval_steps == AUTO
        self.interval_steps: int | None = None if self.auto else int(interval_steps)
        self._untold: AutoInterval | None = None  # auto's decision, until the loop takes it for its event
        self._probe: tuple[int, float, float] | None = None  # auto: (first step seen, its clock, waited_s then)
        self._last_saved: int | None = None
        self.node = node_name()
        self.folder = node_dir(base, key.job, self.node)
        self._pg = dist.new_group(backend="gloo") if dist.is_available() and dist.is_initialized() else None
        self.hosts = self._gather(self.node)
        self.mtbi_s = mtbi_s(interruptions_per_day, len(set(self.hosts)))
        pairs = buddies(self.hosts)
        self.buddy = pairs[rank]
        self.sources = [r for r, b in enumerate(pairs) if b == rank]
        self.first_on_node = self.hosts.index(self.node) == rank
        self.enabled = True
        self._stager = stage_in_background(torch.cuda.is_available())
        self._committer = ThreadPoolExecutor(1, thread_name_prefix="memory-tier")
        self._pending: Future | None = None
        self._gate: StagingGate | None = None
        self.waited_s = 0.0  # the loop's time in save() and in the optimizer's wait for the copy (the bench reads it)
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            if self.first_on_node:
                # Leftovers of a save cut short and of another attempt of this job are never resumed from.
                held = {h.step for h in scan_node(self.folder, key)}
                for step, step_dir in step_dirs(self.folder):
                    if step not in held:
                        remove_step(step_dir)
        except OSError as exc:
            self._off(f"cannot use {self.folder} ({exc})")
        self._agree_enabled()

    # -- save ------------------------------------------------------------------------------------

    def due(self, step: int, max_steps: int) -> bool:
        """Whether to snapshot after ``step``; called after every step (auto measures between the calls)."""
        if not self.enabled or step >= max_steps:
            return False
        if not self.auto:
            return step % self.interval_steps == 0
        if self._probe is None:
            self._probe = (step, time.monotonic(), self.waited_s)
        first = self._probe[0]
        if self.interval_steps is None:
            if step != first + 2 * PROBE_STEPS:
                return step == first + PROBE_STEPS
            self._decide(step)
        # Decided at this step: a snapshot the new interval makes due now is taken now, not a step late.
        return step - (self._last_saved or first) >= self.interval_steps

    def _decide(self, step: int) -> None:
        """auto: the interval from the probe snapshot's stall (the loop's waits since the probe began, the copy's
        wait in the next steps included) and the step time without it; the slowest rank's figures, so that every
        rank computes the same interval."""
        first, clock, waited = self._probe
        stall = self.waited_s - waited
        step_s = (time.monotonic() - clock - stall) / (step - first)
        figures = torch.tensor([stall, step_s], dtype=torch.float64)
        # The probe's commit runs collectives on this group in the tier's thread: it must be over before this
        # thread runs one there (measured before, so the decision does not count this wait).
        self.wait()
        if self._pg is not None:
            dist.all_reduce(figures, op=dist.ReduceOp.MAX, group=self._pg)
        choice = auto_interval(float(figures[0]), float(figures[1]), self.mtbi_s)
        self.interval_steps, self._untold = choice.steps, choice
        if self.rank == 0:
            log.info("%s, from step %d", choice.text(), step)

    def take_auto_choice(self) -> AutoInterval | None:
        choice, self._untold = self._untold, None
        return choice

    def save(self, step: int, state: dict[str, Any]) -> None:
        """Start the snapshot of ``step`` (the previous one is finished first); returns once it is staged."""
        started = time.monotonic()
        self._last_saved = step
        self.wait()
        if not self.enabled:
            return
        step_dir = self.folder / step_dir_name(step)
        try:
            if self.first_on_node and step_dir.exists():
                remove_step(step_dir)
            self._barrier()
            step_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            self._off(f"cannot create {step_dir} ({exc})")
        if not self._agree_enabled():
            return
        facts = save_facts(step, state, reason="memory", eval_loss=None, world_size=self.world_size, run=self.run)
        future, self._gate = start_async_save(
            state, storage_writer=CheckpointWriter(str(step_dir)), async_stager=self._stager,
            process_group=self._pg, no_dist=self._pg is None)
        self._pending = self._committer.submit(self._commit, step, step_dir, facts, future, started)
        self.waited_s += time.monotonic() - started

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

    def _commit(self, step: int, step_dir: Path, facts: Sidecar, future: Future, started: float) -> None:
        """In the tier's thread, on every rank: the write's end, the replicas, the parts, the markers."""
        ok = True
        try:
            future.result()  # DCP's last collective: every rank's shard is written, rank 0's .metadata too
        except Exception as exc:  # noqa: BLE001 - a failed snapshot turns the tier off, never the run
            ok = self._failed(f"snapshot of step {step} failed ({type(exc).__name__}: {exc})")
        shared: list[Any] = [None]
        if self.rank == 0 and ok:
            sidecar = replace(facts, wall_time=time.time(), save_seconds=round(time.monotonic() - started, 3))
            shared[0] = ((step_dir / METADATA).read_bytes(), sidecar)
        if self._pg is not None:
            dist.broadcast_object_list(shared, src=0, group=self._pg)
        ok = ok and shared[0] is not None
        files: dict[str, int] = {}
        try:
            if ok and self.first_on_node:
                metadata, sidecar = shared[0]
                if self.rank != 0:
                    _write_bytes(step_dir / METADATA, metadata)
                sidecar.write(step_dir)
            own = step_dir / shard_name(self.rank)
            if ok:
                files[own.name] = own.stat().st_size
        except OSError as exc:
            ok = self._failed(f"step {step}: {exc}")
        files.update(self._replicate(step_dir, ok))
        try:
            if ok:
                write_atomic(step_dir / part_name(self.rank), _part_text(step, self.key, self.rank, files))
        except OSError as exc:
            ok = self._failed(f"step {step}: cannot record this rank's part ({exc})")
        if not self._all(ok):
            self.enabled = False
            if self.first_on_node:
                remove_step(step_dir)
            log.warning("memory tier off for the rest of this launch: step %d is incomplete on some rank; "
                        "a restart resumes from the durable checkpoints", step)
            return
        if self.first_on_node:
            write_atomic(step_dir / MARKER, marker_text(step, self.key, self.world_size, self.hosts))
        self._barrier()  # committed on every node before any node drops its older step
        if self.first_on_node:
            for older, older_dir in step_dirs(self.folder):
                if older < step:
                    remove_step(older_dir)
        log.info("memory tier: step %d committed on %s (%.2f s)", step, self.node, time.monotonic() - started)

    def _replicate(self, step_dir: Path, ok: bool) -> dict[str, int]:
        """Send this rank's shard to its buddy, receive the shards of the ranks whose buddy this is (sizes first,
        -1 for none); write them next to the own ones. Every rank takes part even when its write failed."""
        if self.buddy is None or self._pg is None:
            return {}
        data = b""
        if ok:
            try:
                data = (step_dir / shard_name(self.rank)).read_bytes()
            except OSError:
                ok = False
        size_out = torch.tensor([len(data) if ok else -1], dtype=torch.int64)
        sizes_in = {s: torch.zeros(1, dtype=torch.int64) for s in self.sources}
        ops = [dist.isend(size_out, self.buddy, group=self._pg)]
        ops += [dist.irecv(t, s, group=self._pg) for s, t in sizes_in.items()]
        for op in ops:
            op.wait()
        ops, buffers = [], {}
        if ok:
            ops.append(dist.isend(torch.frombuffer(bytearray(data), dtype=torch.uint8), self.buddy, group=self._pg))
        for s, t in sizes_in.items():
            if int(t.item()) >= 0:
                buffers[s] = torch.empty(int(t.item()), dtype=torch.uint8)
                ops.append(dist.irecv(buffers[s], s, group=self._pg))
        for op in ops:
            op.wait()
        written = {}
        for s, buf in buffers.items():
            try:
                _write_bytes(step_dir / shard_name(s), memoryview(buf.numpy()))
                written[shard_name(s)] = buf.numel()
            except OSError as exc:
                log.warning("memory tier: cannot keep rank %d's replica on %s (%s)", s, self.node, exc)
        return written

    # -- resume ----------------------------------------------------------------------------------

    def find(self) -> TierChoice | None:
        """The newest step the nodes of this launch hold in full (same answer on every rank), if any."""
        found = self._gather(scan_node(self.folder, self.key) if self.enabled else [])
        choice, skipped = choose_step(found)
        if self.rank == 0:
            for why in skipped:
                log.warning("memory tier: not resuming from %s", why)
        return choice

    def load(self, ckpt: CheckpointManager, choice: TierChoice, state: dict[str, Any]) -> Sidecar:
        """Load ``state`` from the tier's step ``choice.step`` through the durable manager's load (its checks,
        the RNG's re-derivation on another world size), reading what this node lacks from the others."""
        work = self.folder / f"load-{self.rank}"
        step_dir = self.folder / step_dir_name(choice.step)
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        shared: list[Any] = [None]
        src = choice.metadata_holders[0]
        if self.rank == src:
            shared[0] = ((step_dir / METADATA).read_bytes(), (step_dir / SIDECAR).read_bytes())
        if self._pg is not None:
            dist.broadcast_object_list(shared, src=src, group=self._pg)
        _write_bytes(work / METADATA, shared[0][0])
        _write_bytes(work / SIDECAR, shared[0][1])
        for name, ranks in choice.holders.items():
            if self.rank in ranks:
                (work / name).symlink_to(step_dir / name)
        try:
            return ckpt.load(work, state, reader=lambda path: _TierReader(path, fetch=self._fetcher(choice, step_dir)))
        finally:
            shutil.rmtree(work, ignore_errors=True)

    def _fetcher(self, choice: TierChoice, step_dir: Path) -> Callable[[Path, dict[str, list[tuple[int, int]]]], None]:
        def fetch(work: Path, needs: dict[str, list[tuple[int, int]]]) -> None:
            """Collective: every rank's missing byte ranges, each sent by the lowest rank whose node holds the file
            (pairs in one global order, so blocking sends and receives always meet)."""
            everyone = self._gather(needs)
            for needer, wanted in enumerate(everyone):
                for name in sorted(wanted):
                    ranges = wanted[name]
                    src = min(choice.holders[name])
                    if self.rank == src:
                        with open(step_dir / name, "rb") as f:
                            chunks = [os.pread(f.fileno(), length, offset) for offset, length in ranges]
                        dist.send(torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8), needer,
                                  group=self._pg)
                    elif self.rank == needer:
                        buf = torch.empty(sum(n for _, n in ranges), dtype=torch.uint8)
                        dist.recv(buf, src, group=self._pg)
                        view, done = memoryview(buf.numpy()), 0
                        fd = os.open(work / name, os.O_WRONLY | os.O_CREAT, 0o600)
                        try:
                            for offset, length in ranges:
                                os.pwrite(fd, view[done:done + length], offset)
                                done += length
                        finally:
                            os.close(fd)
        return fetch

    def forget_after(self, step: int) -> None:
        """Drop this job's tier steps newer than ``step``, the one this launch resumed from: training goes on from
        there, so they must never be chosen later."""
        if self.first_on_node:
            for newer, step_dir in step_dirs(self.folder):
                if newer > step:
                    remove_step(step_dir)
        self._barrier()

    # -- end -------------------------------------------------------------------------------------

    def close(self, *, remove: bool, crashed: bool = False) -> None:
        """Free the staging buffers and the group; ``remove`` (the job completed): delete this node's tier. After a
        crash nothing is waited for (a peer may be gone) and the tier stays for the next launch."""
        try:
            if not crashed:
                self.wait()
        finally:
            self._committer.shutdown(wait=not crashed, cancel_futures=True)
            self._stager.close()
            if remove and self.first_on_node:
                shutil.rmtree(self.folder, ignore_errors=True)
                try:
                    self.folder.parent.rmdir()  # the job's folder, once its last node folder on this host is gone
                except OSError:
                    pass
            if self._pg is not None and not crashed:
                dist.destroy_process_group(self._pg)
            self._pg = None

    # -- helpers ---------------------------------------------------------------------------------

    def _off(self, why: str) -> None:
        self.enabled = False
        log.warning("memory tier off on %s: %s; restarts resume from the durable checkpoints", self.node, why)

    def _failed(self, why: str) -> bool:
        log.warning("memory tier on %s: %s", self.node, why)
        return False

    def _agree_enabled(self) -> bool:
        self.enabled = self._all(self.enabled)
        return self.enabled

    def _all(self, flag: bool) -> bool:
        if self._pg is None:
            return flag
        value = torch.tensor([int(flag)], dtype=torch.int32)
        dist.all_reduce(value, op=dist.ReduceOp.MIN, group=self._pg)
        return bool(value.item())

    def _gather(self, value: Any) -> list[Any]:
        if self._pg is None:
            return [value]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, value, group=self._pg)
        return out

    def _barrier(self) -> None:
        if self._pg is not None:
            dist.barrier(group=self._pg)


def _part_text(step: int, key: TierKey, rank: int, files: dict[str, int]) -> str:
    import json
    from dataclasses import asdict

    return json.dumps({"step": step, **asdict(key), "rank": rank, "files": files}) + "\n"


class _TierReader(CheckpointReader):
    """CheckpointReader over a rank's load folder: before reading, the byte ranges of the items the plan gives this
    rank that its node lacks are fetched from other nodes (``fetch``, collective: every rank reads once)."""

    def __init__(self, path: str, *, fetch: Callable[[Path, dict[str, list[tuple[int, int]]]], None]) -> None:
        super().__init__(path)
        self.fetch = fetch

    def read_data(self, plan: Any, planner: Any) -> Any:
        work = Path(self.path)
        needs: dict[str, list[tuple[int, int]]] = {}
        for item in plan.items:
            info = self.storage_data[item.storage_index]
            if not (work / info.relative_path).is_symlink():  # not on this node: fetched (again) for this load
                needs.setdefault(info.relative_path, []).append((info.offset, info.length))
        for ranges in needs.values():
            ranges.sort()
        self.fetch(work, needs)
        return super().read_data(plan, planner)
