"""The memory tier's replicas: each rank's shard of a snapshot also goes to its buddy, a rank on the next node
(core/memtier.buddies), so a snapshot survives the loss of any one node.

A shard is as large as the rank's saved state (params + both AdamW moments: 12 GB per rank for 8B on 8 GPUs). It is
sent from the pages of the rank's own file, mapped as it was written (raw.fill), and received straight into the
pages of the replica's file, mapped the same way: no buffer, no read back, no second write. It travels in messages
of at most REPLICA_CHUNK_BYTES (each a slice of the mappings), sizes first (-1: none). The replica is filled under a
temporary name and renamed into place only once whole (node.ShmMap), so a half-received replica is never listed in
the part nor found by a scan; one whose file cannot be made (shared memory full) is still received, into one
message's worth of scratch, and dropped."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from fsdpjob.orchestrator.core.runfolder.memtier import REPLICA_CHUNK_BYTES, shard_name

from .node import ShmMap, TierNode

log = logging.getLogger("fsdpjob.checkpoint")


@dataclass
class _Inbound:
    """The replica arriving from rank ``src``: its size, the file it goes into (None where it could not be made) and
    why it cannot be kept."""

    src: int
    size: int
    file: ShmMap | None
    error: str = ""
    scratch: torch.Tensor | None = None

    def target(self, start: int, n: int) -> torch.Tensor:
        """Where the bytes [start, start + n) of the replica are received."""
        if self.file is not None and self.file.data is not None:
            return self.file.data[start: start + n]
        if self.scratch is None or self.scratch.numel() < n:
            self.scratch = torch.empty(n, dtype=torch.uint8)
        return self.scratch[:n]


def _open_inbound(path: Path, src: int, size: int, reuse: Path | None) -> _Inbound:
    try:
        return _Inbound(src, size, ShmMap(path, size, reuse))
    except OSError as exc:
        return _Inbound(src, size, None, str(exc))


def _pieces(size: int, chunk_bytes: int) -> list[int]:
    """The lengths of the messages a file of ``size`` bytes travels in (none for an empty or missing file)."""
    return [min(chunk_bytes, size - start) for start in range(0, max(size, 0), chunk_bytes)]


def _exchange_sizes(node: TierNode, size: int) -> dict[int, int]:
    """Send this rank's shard size to the buddy (-1: none), receive the sources' (the only collective-like step)."""
    size_out = torch.tensor([size], dtype=torch.int64)
    sizes_in = {s: torch.zeros(1, dtype=torch.int64) for s in node.sources}
    ops = [dist.isend(size_out, node.buddy, group=node.pg)]
    ops += [dist.irecv(t, s, group=node.pg) for s, t in sizes_in.items()]
    for op in ops:
        op.wait()
    return {s: int(t.item()) for s, t in sizes_in.items()}


def _stream(node: TierNode, own: torch.Tensor | None, inbound: list[_Inbound], chunk_bytes: int) -> None:
    """Round by round, the next message of the own shard to the buddy and the next one of each inbound replica in."""
    plan_out = _pieces(own.numel(), chunk_bytes) if own is not None else []
    plans_in = [_pieces(i.size, chunk_bytes) for i in inbound]
    for r in range(max([len(plan_out), *map(len, plans_in)], default=0)):
        ops = []
        if r < len(plan_out):
            ops.append(dist.isend(own[r * chunk_bytes: r * chunk_bytes + plan_out[r]], node.buddy, group=node.pg))
        ops += [dist.irecv(i.target(r * chunk_bytes, plan[r]), i.src, group=node.pg)
                for i, plan in zip(inbound, plans_in) if r < len(plan)]
        for op in ops:
            op.wait()


def replicate(node: TierNode, step_dir: Path, own: torch.Tensor | None, *,
              chunk_bytes: int = REPLICA_CHUNK_BYTES) -> dict[str, int]:
    """Send this rank's shard (``own``: its file's bytes; None where its write failed) to its buddy, receive the
    shards of the ranks whose buddy this is into their files next to the own ones. Every rank takes part whatever
    happened to its write. Returns the replicas written here: file name -> size."""
    if node.buddy is None or node.pg is None:
        return {}
    inbound: list[_Inbound] = []
    try:
        sizes = _exchange_sizes(node, own.numel() if own is not None else -1)
        inbound = [_open_inbound(step_dir / shard_name(s), s, n, node.spare / shard_name(s))
                   for s, n in sizes.items() if n >= 0]
        _stream(node, own, inbound, chunk_bytes)
    except BaseException:  # the group failed (a peer gone): no piece of a replica stays behind
        for i in inbound:
            if i.file is not None:
                i.file.drop()
        raise
    return _keep(node, inbound)


def _keep(node: TierNode, inbound: list[_Inbound]) -> dict[str, int]:
    """Rename each whole replica into place; drop the others."""
    written = {}
    for i in inbound:
        if i.file is not None:
            try:
                i.file.commit()
                written[shard_name(i.src)] = i.size
                continue
            except OSError as exc:
                i.error = str(exc)
                i.file.drop()
        log.warning("memory tier: cannot keep rank %d's replica on %s (%s)", i.src, node.node, i.error)
    return written
