"""The memory tier's replica exchange on two real gloo ranks as two nodes (n1, n2; each keeps the other's replica):
the chunked stream round-trips every byte at the sizes around a chunk's edges, a replica whose sender failed is
never kept, and the process holds two chunk buffers during the exchange, never a copy of the shard."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from distributed import run_ranks

pytestmark = pytest.mark.distributed

CHUNK = 1000  # small, so every edge case is a few chunks
SIZES = [0, 1, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK + 5]
MiB = 2**20


def _node(rank: int, world_size: int, base: str):
    import torch.distributed as dist

    from fsdpjob.jobs.checkpoint.memnode import TierNode
    from fsdpjob.orchestrator.core.runfolder.memtier import TierKey

    os.environ["SLURMD_NODENAME"] = f"n{rank + 1}"
    dist.init_process_group("gloo")
    return TierNode(base, TierKey("job", 0, "spec"), rank=rank, world_size=world_size)


def _content(rank: int, size: int) -> bytes:
    return bytes((rank * 7 + i * 31 + size) % 251 for i in range(size))


def _round_trips(rank: int, world_size: int, base: str) -> dict:
    """Each size: both ranks' shards across; then a sender that cannot read its shard half-way (rank 0)."""
    import torch.distributed as dist

    from fsdpjob.jobs.checkpoint import memreplicate
    from fsdpjob.orchestrator.core.runfolder.memtier import shard_name

    node = _node(rank, world_size, base)
    other = 1 - rank
    out: dict = {"sizes": {}}
    for size in SIZES:
        step_dir = node.folder / f"size-{size}"
        step_dir.mkdir(parents=True)
        (step_dir / shard_name(rank)).write_bytes(_content(rank, size))
        written = memreplicate.replicate(node, step_dir, True, chunk_bytes=CHUNK)
        got = (step_dir / shard_name(other)).read_bytes()
        out["sizes"][size] = (written, got == _content(other, size), sorted(p.name for p in step_dir.iterdir()))
    real = memreplicate._read_full

    def fails_on_the_second_chunk(reader, view):
        if reader.tell() >= CHUNK:
            raise OSError("EIO")
        real(reader, view)

    if rank == 0:
        memreplicate._read_full = fails_on_the_second_chunk
    step_dir = node.folder / "failed"
    step_dir.mkdir(parents=True)
    (step_dir / shard_name(rank)).write_bytes(_content(rank, 3 * CHUNK))
    written = memreplicate.replicate(node, step_dir, True, chunk_bytes=CHUNK)
    out["failed"] = (written, sorted(p.name for p in step_dir.iterdir()))
    dist.destroy_process_group()
    return out


def test_the_chunked_stream_round_trips_every_size_exactly_and_drops_a_replica_whose_sender_failed(tmp_path):
    from fsdpjob.orchestrator.core.runfolder.memtier import shard_name

    for rank, out in enumerate(run_ranks(_round_trips, 2, base=str(tmp_path))):
        other = 1 - rank
        for size, (written, same, names) in out["sizes"].items():
            assert written == {shard_name(other): size} and same, size
            assert names == sorted([shard_name(0), shard_name(1)]), size  # no temporary file left
        written, names = out["failed"]
        if rank == 1:  # rank 0 read its second chunk with an error: its replica is not kept, nor a piece of it
            assert written == {} and names == [shard_name(1)]
        else:
            assert written == {shard_name(1): 3 * CHUNK} and names == sorted([shard_name(0), shard_name(1)])


def _exchange_peak(rank: int, world_size: int, base: str, shard: int, chunk: int) -> int:
    """This fresh rank's resident-set rise (bytes) over one replica exchange of a ``shard``-byte shard."""
    import gc

    import torch.distributed as dist

    from fsdpjob.jobs.checkpoint.memreplicate import replicate
    from fsdpjob.orchestrator.core.runfolder.memtier import shard_name

    def status_kib(field: str) -> int:
        return int(re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M).group(1))

    node = _node(rank, world_size, base)
    warm, step_dir = node.folder / "warm", node.folder / "step"
    for folder in (warm, step_dir):
        folder.mkdir(parents=True)
    (warm / shard_name(rank)).write_bytes(b"warm")
    replicate(node, warm, True)  # the group's first exchange, which may set things up
    with open(step_dir / shard_name(rank), "wb") as f:  # written a MiB at a time: the file is not in the process
        piece = bytes(range(256)) * (MiB // 256)
        for _ in range(shard // MiB):
            f.write(piece)
    gc.collect()
    dist.barrier()
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS (Linux)
    base_kib = status_kib("VmRSS")
    written = replicate(node, step_dir, True, chunk_bytes=chunk)
    rise = (status_kib("VmHWM") - base_kib) * 1024
    assert written == {shard_name(1 - rank): shard}
    dist.destroy_process_group()
    return rise


@pytest.mark.slow
def test_the_replica_exchange_holds_two_chunk_buffers_never_a_copy_of_the_shard(tmp_path):
    """Reading the shard whole, copying it for the send and receiving the buddy's whole once held 3 shards (384 MiB
    here) during every snapshot; the stream holds one send and one receive buffer (2 x 16 MiB)."""
    shard, chunk = 128 * MiB, 16 * MiB
    rises = run_ranks(_exchange_peak, 2, base=str(tmp_path), shard=shard, chunk=chunk)
    for rise in rises:
        assert rise < 2 * chunk + 16 * MiB < shard, [f"{r / MiB:.1f} MiB" for r in rises]
