"""A resume from the memory tier: the newest step the nodes of this launch hold in full, read on any world size.
DCP's load plan says which items each rank needs; the bytes of those that its own node lacks come over gloo from a
rank whose node has them, in messages of at most REPLICA_CHUNK_BYTES, into a sparse per-rank copy that DCP then
reads as usual."""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from fsdpjob.jobs.checkpoint.manager import CheckpointManager
from fsdpjob.orchestrator.core.runfolder.ckptlayout import SIDECAR, step_dir_name
from fsdpjob.orchestrator.core.runfolder.memtier import (
    METADATA,
    REPLICA_CHUNK_BYTES,
    TierChoice,
    choose_step,
    drop_corrupt,
    scan_node,
)
from fsdpjob.orchestrator.core.runfolder.sidecar import Sidecar

from .node import TierNode, write_to_shm
from .raw import RawReader

log = logging.getLogger("fsdpjob.checkpoint")

# (a rank's load folder, file name -> the (offset, length) ranges it needs) -> None; collective.
Fetch = Callable[[Path, dict[str, list[tuple[int, int]]]], None]


def find(node: TierNode) -> tuple[TierChoice | None, list[str]]:
    """The newest step the nodes of this launch hold in full, their files' bytes checked against their sums (same
    answer on every rank), if any; and why newer steps or files were passed over."""
    found = node.gather(scan_node(node.folder, node.key, verify_rank=node.rank) if node.enabled else [])
    found, corrupt = drop_corrupt(found, node.hosts)
    choice, skipped = choose_step(found)
    skipped = [f"{why}: not loaded" for why in corrupt] + skipped
    if node.rank == 0:
        for why in skipped:
            log.warning("memory tier: not resuming from %s", why)
    return choice, skipped


def load(node: TierNode, ckpt: CheckpointManager, choice: TierChoice, state: dict[str, Any]) -> Sidecar:
    """Load ``state`` from the tier's step ``choice.step`` through the durable manager's load (its checks, the RNG's
    re-derivation on another world size), reading what this node lacks from the others."""
    work = node.folder / f"load-{node.rank}"
    step_dir = node.folder / step_dir_name(choice.step)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    shared: list[Any] = [None]
    src = choice.metadata_holders[0]
    if node.rank == src:
        shared[0] = ((step_dir / METADATA).read_bytes(), (step_dir / SIDECAR).read_bytes())
    if node.pg is not None:
        dist.broadcast_object_list(shared, src=src, group=node.pg)
    write_to_shm(work / METADATA, shared[0][0])
    write_to_shm(work / SIDECAR, shared[0][1])
    for name, ranks in choice.holders.items():
        if node.rank in ranks:
            (work / name).symlink_to(step_dir / name)
    fetch = fetcher(node, choice, step_dir)
    try:
        return ckpt.load(work, state, reader=lambda path: _FetchingReader(path, fetch=fetch))
    finally:
        shutil.rmtree(work, ignore_errors=True)


def fetcher(node: TierNode, choice: TierChoice, step_dir: Path, chunk_bytes: int = REPLICA_CHUNK_BYTES) -> Fetch:
    """The collective that brings each rank the byte ranges it lacks. They travel in messages of at most
    ``chunk_bytes`` through one buffer on each side (a rank may need gigabytes of a file: the whole of them read,
    joined and received at once held three copies in host memory during a resume)."""

    def fetch(work: Path, needs: dict[str, list[tuple[int, int]]]) -> None:
        """Every rank's missing byte ranges, each file's sent by the lowest rank whose node holds it (pairs and
        messages in one global order, so blocking sends and receives always meet)."""
        everyone = node.gather(needs)
        for needer, wanted in enumerate(everyone):
            for name in sorted(wanted):
                src = min(choice.holders[name])
                if node.rank not in (src, needer):
                    continue
                messages = _messages(wanted[name], chunk_bytes)
                if not messages:  # only empty items (a 0-element tensor): nothing travels
                    continue
                buffer = torch.empty(max(sum(n for _, n in m) for m in messages), dtype=torch.uint8)
                view = memoryview(buffer.numpy())
                fd = os.open(step_dir / name if node.rank == src else work / name,
                             os.O_RDONLY if node.rank == src else os.O_WRONLY | os.O_CREAT, 0o600)
                try:
                    for message in messages:
                        size = sum(n for _, n in message)
                        if node.rank == src:
                            _read_ranges(fd, view, message, name)
                            dist.send(buffer[:size], needer, group=node.pg)
                        else:
                            dist.recv(buffer[:size], src, group=node.pg)
                            _write_ranges(fd, view, message)
                finally:
                    os.close(fd)
    return fetch


def _messages(ranges: list[tuple[int, int]], chunk_bytes: int) -> list[list[tuple[int, int]]]:
    """``ranges`` (offset, length) cut into messages of at most ``chunk_bytes`` bytes, in order; a range longer
    than that spans several."""
    messages, current, size = [], [], 0
    for offset, length in ranges:
        while length:
            take = min(length, chunk_bytes - size)
            current.append((offset, take))
            offset, length, size = offset + take, length - take, size + take
            if size == chunk_bytes:
                messages.append(current)
                current, size = [], 0
    return messages + ([current] if current else [])


def _read_ranges(fd: int, view: memoryview, ranges: list[tuple[int, int]], name: str) -> None:
    """The ranges' bytes of ``fd``, one after another, into ``view``."""
    done = 0
    for offset, length in ranges:
        while length:
            got = os.preadv(fd, [view[done:done + length]], offset)
            if not got:
                raise OSError(f"memory tier: {name} ends before byte {offset + length}")
            done, offset, length = done + got, offset + got, length - got


def _write_ranges(fd: int, view: memoryview, ranges: list[tuple[int, int]]) -> None:
    """``view``, the ranges' bytes one after another, each at its offset of ``fd`` (a sparse file)."""
    done = 0
    for offset, length in ranges:
        while length:
            put = os.pwrite(fd, view[done:done + length], offset)
            done, offset, length = done + put, offset + put, length - put


class _FetchingReader(RawReader):
    """RawReader over a rank's load folder: before reading, the byte ranges of the items the plan gives this
    rank that its node lacks are fetched from other nodes (``fetch``, collective: every rank reads once)."""

    def __init__(self, path: str, *, fetch: Fetch) -> None:
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
