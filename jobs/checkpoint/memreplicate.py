"""The memory tier's replicas: each rank's shard of a snapshot also goes to its buddy, a rank on the next node
(core/memtier.buddies), so a snapshot survives the loss of any one node."""

from __future__ import annotations

import logging
from pathlib import Path

import torch
import torch.distributed as dist

from fsdpjob.orchestrator.core.runfolder.memtier import shard_name

from .memnode import TierNode, write_to_shm

log = logging.getLogger("fsdpjob.checkpoint")


def replicate(node: TierNode, step_dir: Path, ok: bool) -> dict[str, int]:
    """Send this rank's shard to its buddy, receive the shards of the ranks whose buddy this is (sizes first, -1 for
    none); write them next to the own ones. Every rank takes part even when its write failed (``ok`` False).
    Returns the replicas written here: file name -> size."""
    if node.buddy is None or node.pg is None:
        return {}
    data = b""
    if ok:
        try:
            data = (step_dir / shard_name(node.rank)).read_bytes()
        except OSError:
            ok = False
    size_out = torch.tensor([len(data) if ok else -1], dtype=torch.int64)
    sizes_in = {s: torch.zeros(1, dtype=torch.int64) for s in node.sources}
    ops = [dist.isend(size_out, node.buddy, group=node.pg)]
    ops += [dist.irecv(t, s, group=node.pg) for s, t in sizes_in.items()]
    for op in ops:
        op.wait()
    ops, buffers = [], {}
    if ok:
        ops.append(dist.isend(torch.frombuffer(bytearray(data), dtype=torch.uint8), node.buddy, group=node.pg))
    for s, t in sizes_in.items():
        if int(t.item()) >= 0:
            buffers[s] = torch.empty(int(t.item()), dtype=torch.uint8)
            ops.append(dist.irecv(buffers[s], s, group=node.pg))
    for op in ops:
        op.wait()
    written = {}
    for s, buf in buffers.items():
        try:
            write_to_shm(step_dir / shard_name(s), memoryview(buf.numpy()))
            written[shard_name(s)] = buf.numel()
        except OSError as exc:
            log.warning("memory tier: cannot keep rank %d's replica on %s (%s)", s, node.node, exc)
    return written
