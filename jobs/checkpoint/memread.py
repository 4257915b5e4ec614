"""A resume from the memory tier: the newest step the nodes of this launch hold in full, read on any world size.
DCP's load plan says which items each rank needs; the bytes of those that its own node lacks come over gloo from a
rank whose node has them, into a sparse per-rank copy that DCP then reads as usual."""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from fsdpjob.orchestrator.core.runfolder.ckptlayout import SIDECAR, step_dir_name
from fsdpjob.orchestrator.core.runfolder.memtier import METADATA, TierChoice, choose_step, scan_node
from fsdpjob.orchestrator.core.runfolder.sidecar import Sidecar

from .io import CheckpointReader
from .manager import CheckpointManager
from .memnode import TierNode, write_to_shm

log = logging.getLogger("fsdpjob.checkpoint")

# (a rank's load folder, file name -> the (offset, length) ranges it needs) -> None; collective.
Fetch = Callable[[Path, dict[str, list[tuple[int, int]]]], None]


def find(node: TierNode) -> TierChoice | None:
    """The newest step the nodes of this launch hold in full (same answer on every rank), if any."""
    found = node.gather(scan_node(node.folder, node.key) if node.enabled else [])
    choice, skipped = choose_step(found)
    if node.rank == 0:
        for why in skipped:
            log.warning("memory tier: not resuming from %s", why)
    return choice


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
    fetch = _fetcher(node, choice, step_dir)
    try:
        return ckpt.load(work, state, reader=lambda path: _FetchingReader(path, fetch=fetch))
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _fetcher(node: TierNode, choice: TierChoice, step_dir: Path) -> Fetch:
    def fetch(work: Path, needs: dict[str, list[tuple[int, int]]]) -> None:
        """Collective: every rank's missing byte ranges, each sent by the lowest rank whose node holds the file
        (pairs in one global order, so blocking sends and receives always meet)."""
        everyone = node.gather(needs)
        for needer, wanted in enumerate(everyone):
            for name in sorted(wanted):
                ranges = wanted[name]
                src = min(choice.holders[name])
                if node.rank == src:
                    with open(step_dir / name, "rb") as f:
                        chunks = [os.pread(f.fileno(), length, offset) for offset, length in ranges]
                    dist.send(torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8), needer, group=node.pg)
                elif node.rank == needer:
                    buf = torch.empty(sum(n for _, n in ranges), dtype=torch.uint8)
                    dist.recv(buf, src, group=node.pg)
                    _write_ranges(work / name, memoryview(buf.numpy()), ranges)
    return fetch


def _write_ranges(path: Path, data: memoryview, ranges: list[tuple[int, int]]) -> None:
    """``data``, the ranges' bytes one after another, each at its offset of ``path`` (a sparse file)."""
    done = 0
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        for offset, length in ranges:
            os.pwrite(fd, data[done:done + length], offset)
            done += length
    finally:
        os.close(fd)


class _FetchingReader(CheckpointReader):
    """CheckpointReader over a rank's load folder: before reading, the byte ranges of the items the plan gives this
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
