"""The memory tier's replicas: each rank's shard of a snapshot also goes to its buddy, a rank on the next node
(core/memtier.buddies), so a snapshot survives the loss of any one node.

A shard is as large as the rank's saved state (params + both AdamW moments: 12 GB per rank for 8B on 8 GPUs), so
it travels in chunks of at most REPLICA_CHUNK_BYTES through one buffer per direction: read from the own file into
the send buffer, received into a buffer per source and appended to the replica's file as it arrives. The process
never holds a whole shard (reading it whole, copying it for the send and receiving the buddy's whole once cost
three full copies of the rank's state in host RAM during every snapshot). Every rank sends its size first (-1 for
none), then both sides know how many chunks pass; a last flag says whether the sender read its whole file. The
replica is written under a temporary name and renamed into place only once whole and flagged good
(memnode.ShmFile), so a half-received replica is never listed in the part nor found by a scan."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from io import BufferedReader
from pathlib import Path

import torch
import torch.distributed as dist

from fsdpjob.orchestrator.core.runfolder.memtier import REPLICA_CHUNK_BYTES, shard_name

from .memnode import ShmFile, TierNode

log = logging.getLogger("fsdpjob.checkpoint")


@dataclass
class _Inbound:
    """The replica arriving from rank ``src``: its size, the file it goes into (None once writing failed), its
    receive buffer and why it cannot be kept."""

    src: int
    size: int
    file: ShmFile | None
    buffer: torch.Tensor
    error: str = ""

    def write(self, n: int) -> None:
        if self.file is None:
            return
        try:
            self.file.write(memoryview(self.buffer.numpy())[:n])
        except OSError as exc:
            self.file.drop()
            self.file, self.error = None, str(exc)


def _open_inbound(path: Path, src: int, size: int, chunk_bytes: int) -> _Inbound:
    buffer = torch.empty(min(size, chunk_bytes), dtype=torch.uint8)
    try:
        return _Inbound(src, size, ShmFile(path), buffer)
    except OSError as exc:
        return _Inbound(src, size, None, buffer, str(exc))


def _pieces(size: int, chunk_bytes: int) -> list[int]:
    """The lengths of the chunks a file of ``size`` bytes travels in (none for an empty or missing file)."""
    return [min(chunk_bytes, size - start) for start in range(0, max(size, 0), chunk_bytes)]


def _read_full(reader: BufferedReader, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = reader.readinto(view[got:])
        if not n:
            raise OSError(f"{reader.name}: ended {len(view) - got} bytes early")
        got += n


def _exchange_sizes(node: TierNode, size: int) -> dict[int, int]:
    """Send this rank's shard size to the buddy (-1: none), receive the sources' (the only collective-like step)."""
    size_out = torch.tensor([size], dtype=torch.int64)
    sizes_in = {s: torch.zeros(1, dtype=torch.int64) for s in node.sources}
    ops = [dist.isend(size_out, node.buddy, group=node.pg)]
    ops += [dist.irecv(t, s, group=node.pg) for s, t in sizes_in.items()]
    for op in ops:
        op.wait()
    return {s: int(t.item()) for s, t in sizes_in.items()}


def _stream(node: TierNode, reader: BufferedReader | None, size: int, inbound: list[_Inbound],
            chunk_bytes: int) -> dict[int, bool]:
    """Round by round, the next chunk of the own shard to the buddy and the next chunk of each inbound replica in
    (each round waits for its sends before the buffer is refilled); then each sender's flag, whether it read its
    whole file. Returns the flags by source. A failed read still sends its chunks (the receiver expects them) and
    flags the replica bad."""
    out = torch.empty(min(max(size, 0), chunk_bytes), dtype=torch.uint8)
    read_ok = reader is not None
    plan_out = _pieces(size, chunk_bytes) if reader is not None else []
    plans_in = [_pieces(i.size, chunk_bytes) for i in inbound]
    for r in range(max([len(plan_out), *map(len, plans_in)], default=0)):
        ops = []
        if r < len(plan_out):
            piece = out[: plan_out[r]]
            if read_ok:
                try:
                    _read_full(reader, memoryview(piece.numpy()))
                except OSError as exc:
                    read_ok = False
                    log.warning("memory tier: cannot read rank %d's shard for its replica (%s)", node.rank, exc)
            ops.append(dist.isend(piece, node.buddy, group=node.pg))
        lengths = [plan[r] if r < len(plan) else 0 for plan in plans_in]
        ops += [dist.irecv(i.buffer[:n], i.src, group=node.pg) for i, n in zip(inbound, lengths) if n]
        for op in ops:
            op.wait()
        for i, n in zip(inbound, lengths):
            if n:
                i.write(n)
    flags = {i.src: torch.zeros(1, dtype=torch.int64) for i in inbound}
    ops = [dist.isend(torch.tensor([int(read_ok)], dtype=torch.int64), node.buddy, group=node.pg)] if size >= 0 else []
    ops += [dist.irecv(t, s, group=node.pg) for s, t in flags.items()]
    for op in ops:
        op.wait()
    return {s: bool(t.item()) for s, t in flags.items()}


def replicate(node: TierNode, step_dir: Path, ok: bool, *, chunk_bytes: int = REPLICA_CHUNK_BYTES) -> dict[str, int]:
    """Send this rank's shard to its buddy, receive the shards of the ranks whose buddy this is, in chunks of at
    most ``chunk_bytes``; write them next to the own ones. Every rank takes part even when its write failed (``ok``
    False). Returns the replicas written here: file name -> size."""
    if node.buddy is None or node.pg is None:
        return {}
    reader, size = None, -1
    if ok:
        try:
            reader = open(step_dir / shard_name(node.rank), "rb")  # closed below
            size = os.fstat(reader.fileno()).st_size
        except OSError:
            reader, size = None, -1
    inbound: list[_Inbound] = []
    try:
        sizes = _exchange_sizes(node, size)
        inbound = [_open_inbound(step_dir / shard_name(s), s, n, chunk_bytes) for s, n in sizes.items() if n >= 0]
        flags = _stream(node, reader, size, inbound, chunk_bytes)
    except BaseException:  # the group failed (a peer gone): no piece of a replica stays behind
        for i in inbound:
            if i.file is not None:
                i.file.drop()
        raise
    finally:
        if reader is not None:
            reader.close()
    return _keep(node, inbound, flags)


def _keep(node: TierNode, inbound: list[_Inbound], flags: dict[int, bool]) -> dict[str, int]:
    """Rename each whole replica into place; drop the others."""
    written = {}
    for i in inbound:
        if i.file is not None and flags[i.src]:
            try:
                i.file.commit()
                written[shard_name(i.src)] = i.size
                continue
            except OSError as exc:
                i.error = str(exc)
        if i.file is not None:
            i.file.drop()
        log.warning("memory tier: cannot keep rank %d's replica on %s (%s)", i.src, node.node,
                    i.error or "its sender could not read its shard")
    return written
