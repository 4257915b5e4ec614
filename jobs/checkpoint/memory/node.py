"""The memory tier's place in the world: this node's folder, the tier's own gloo group, which node every rank is on
and whose replica it keeps, whether the tier is still on, and the collectives its writer and reader share."""

from __future__ import annotations

import logging
import mmap
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from fsdpjob.orchestrator.core.runfolder.memtier import TierKey, buddies, node_dir, node_name, shard_name

log = logging.getLogger("fsdpjob.checkpoint")


class ShmFile:
    """A tier file written in pieces under a temporary name and renamed into place only once whole (``commit``), so
    no reader ever sees part of it; ``drop`` removes the piece written so far. No fsync: the tier lives in shared
    memory (/dev/shm), which has no disk behind it to flush to, and its files are lost with the node whatever we
    sync."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        self._file = open(self.tmp, "wb")  # closed by commit or drop

    def write(self, data: bytes | memoryview) -> None:
        self._file.write(data)

    def commit(self) -> None:
        self._file.close()
        os.replace(self.tmp, self.path)

    def drop(self) -> None:
        try:
            self._file.close()
        except OSError:  # its last flush failed (shared memory full): the piece goes all the same
            pass
        self.tmp.unlink(missing_ok=True)


SPARE = "spare"  # a node folder's files of dropped steps, kept for the next snapshot's files to reuse


def map_file(path: Path, size: int, reuse: Path | None = None) -> torch.Tensor:
    """The file ``path`` of ``size`` bytes, mapped shared as a uint8 tensor (writes go straight into its pages; the
    mapping goes when the last tensor viewing it does). ``reuse``, where it exists, is renamed to ``path`` first: a
    file of a dropped step, whose pages are already there, so a snapshot neither zeroes new pages nor frees old ones.
    The blocks are allocated before the mapping: a full /dev/shm fails here with ENOSPC, never as a SIGBUS at the
    first write into the mapping. The mapping is populated up front (one call instead of a fault per page)."""
    if reuse is not None:
        try:
            os.replace(reuse, path)
        except FileNotFoundError:
            pass
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        if os.fstat(fd).st_size > size:
            os.ftruncate(fd, size)
        if not size:  # nothing to map (mmap refuses an empty file)
            return torch.empty(0, dtype=torch.uint8)
        os.posix_fallocate(fd, 0, size)
        mapped = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
    finally:
        os.close(fd)
    return torch.frombuffer(mapped, dtype=torch.uint8)


class ShmMap:
    """A tier file of known size filled through its mapping (``data``) under a temporary name, renamed into place
    only once whole (``commit``); ``drop`` removes it. As ShmFile: no reader ever sees part of it."""

    def __init__(self, path: Path, size: int, reuse: Path | None = None) -> None:
        self.path = path
        self.tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            self.data: torch.Tensor | None = map_file(self.tmp, size, reuse)
        except OSError:
            self.tmp.unlink(missing_ok=True)
            raise

    def commit(self) -> None:
        self.data = None  # unmapped (the pages stay the file's)
        os.replace(self.tmp, self.path)

    def drop(self) -> None:
        self.data = None
        self.tmp.unlink(missing_ok=True)


def write_to_shm(path: Path, data: bytes | memoryview) -> None:
    """Write a tier file whole (ShmFile: tmp + rename, no fsync)."""
    out = ShmFile(path)
    try:
        out.write(data)
        out.commit()
    except OSError:
        out.drop()
        raise


class TierNode:
    """This rank's node folder ``<base>/<job>/<node>/`` and the tier's group; the constructor is collective: it
    creates the gloo group (never the compute stream's) and learns every rank's node (for the buddies)."""

    def __init__(self, base: str | Path, key: TierKey, *, rank: int, world_size: int) -> None:
        self.key, self.rank, self.world_size = key, rank, world_size
        self.node = node_name()
        self.folder = node_dir(base, key.job, self.node)
        self.pg = dist.new_group(backend="gloo") if dist.is_available() and dist.is_initialized() else None
        self.hosts: list[str] = self.gather(self.node)
        pairs = buddies(self.hosts)
        self.buddy = pairs[rank]  # the rank (on the next node) that keeps this rank's replica
        self.sources = [r for r, b in enumerate(pairs) if b == rank]  # the ranks whose replica this rank keeps
        self.first_on_node = self.hosts.index(self.node) == rank  # the rank that writes the node's shared files
        self.enabled = True

    @property
    def spare(self) -> Path:
        return self.folder / SPARE

    def keep_spares(self, step_dir: Path) -> None:
        """Move this rank's files of a dropped step (its own shard, the replicas it received) to the spare folder,
        for the next snapshot to fill again."""
        self.spare.mkdir(exist_ok=True)
        for rank in [self.rank, *self.sources]:
            try:
                os.replace(step_dir / shard_name(rank), self.spare / shard_name(rank))
            except FileNotFoundError:
                pass

    def off(self, why: str) -> None:
        self.enabled = False
        log.warning("memory tier off on %s: %s; restarts resume from the durable checkpoints", self.node, why)

    def failed(self, why: str) -> bool:
        log.warning("memory tier on %s: %s", self.node, why)
        return False

    def agree_enabled(self) -> bool:
        """On only where it is on for every rank (collective)."""
        self.enabled = self.all(self.enabled)
        return self.enabled

    def all(self, flag: bool) -> bool:
        return bool(self.least(int(flag)))

    def least(self, value: int) -> int:
        """The smallest of the ranks' ``value`` (collective)."""
        if self.pg is None:
            return value
        tensor = torch.tensor([value], dtype=torch.int32)
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=self.pg)
        return int(tensor.item())

    def slowest(self, figures: list[float]) -> list[float]:
        """Each figure's largest value over the ranks (collective)."""
        values = torch.tensor(figures, dtype=torch.float64)
        if self.pg is not None:
            dist.all_reduce(values, op=dist.ReduceOp.MAX, group=self.pg)
        return [float(v) for v in values]

    def gather(self, value: Any) -> list[Any]:
        if self.pg is None:
            return [value]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, value, group=self.pg)
        return out

    def barrier(self) -> None:
        if self.pg is not None:
            dist.barrier(group=self.pg)

    def close_group(self, *, crashed: bool) -> None:
        """Destroy the group, except after a crash (a peer may be gone and the destroy wait for it)."""
        if self.pg is not None and not crashed:
            dist.destroy_process_group(self.pg)
        self.pg = None
