"""The memory tier's replica exchange on two real gloo ranks as two nodes (n1, n2; each keeps the other's replica):
every byte round-trips at the sizes around a message's edges, straight from the sender's mapped file into the
receiver's; a sender whose write failed sends nothing and a receiver that cannot make the file (shared memory full)
keeps nothing, the stream staying in step for the next exchange; and the process allocates no buffer of the shard's
size (the bytes go from one file's pages to the other's)."""

from __future__ import annotations

import os
import re
import threading
from pathlib import Path

import pytest
from distributed import run_ranks

pytestmark = pytest.mark.distributed

CHUNK = 1000  # small, so every edge case is a few messages
SIZES = [0, 1, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK + 5]
MiB = 2**20


def _node(rank: int, world_size: int, base: str):
    import torch.distributed as dist

    from fsdpjob.jobs.checkpoint.memory.node import TierNode
    from fsdpjob.orchestrator.core.runfolder.memtier import TierKey

    os.environ["SLURMD_NODENAME"] = f"n{rank + 1}"
    dist.init_process_group("gloo")
    return TierNode(base, TierKey("job", 0, "spec"), rank=rank, world_size=world_size)


def _content(rank: int, size: int) -> bytes:
    return bytes((rank * 7 + i * 31 + size) % 251 for i in range(size))


def _own(step_dir: Path, rank: int, size: int):
    """This rank's shard written and mapped as memraw.fill leaves it."""
    import torch

    from fsdpjob.jobs.checkpoint.memory.node import map_file
    from fsdpjob.orchestrator.core.runfolder.memtier import shard_name

    data = map_file(step_dir / shard_name(rank), size)
    data.copy_(torch.frombuffer(bytearray(_content(rank, size)), dtype=torch.uint8) if size else data)
    return data


def _round_trips(rank: int, world_size: int, base: str) -> dict:
    """Each size: both ranks' shards across; then rank 0's write failed (nothing to send), then rank 1 cannot make
    the replica's file, then a plain exchange again."""
    import torch.distributed as dist

    from fsdpjob.jobs.checkpoint.memory import replicate
    from fsdpjob.orchestrator.core.runfolder.memtier import shard_name

    node = _node(rank, world_size, base)
    other = 1 - rank
    out: dict = {"sizes": {}, "after": {}}

    def exchange(name: str, size: int, own: bool = True) -> tuple:
        step_dir = node.folder / name
        step_dir.mkdir(parents=True)
        data = _own(step_dir, rank, size) if own else None
        written = replicate.replicate(node, step_dir, data, chunk_bytes=CHUNK)
        replica = step_dir / shard_name(other)
        same = replica.exists() and replica.read_bytes() == _content(other, size)
        return written, same, sorted(p.name for p in step_dir.iterdir())

    for size in SIZES:
        out["sizes"][size] = exchange(f"size-{size}", size)
    out["sender failed"] = exchange("sender-failed", 3 * CHUNK, own=rank != 0)
    real = replicate.ShmMap

    def full(path, size, reuse=None):
        raise OSError(28, "No space left on device")

    if rank == 1:
        replicate.ShmMap = full
    out["receiver full"] = exchange("receiver-full", 3 * CHUNK + 5)
    replicate.ShmMap = real
    out["after"] = exchange("after", 2 * CHUNK)
    dist.destroy_process_group()
    return out


def test_every_size_round_trips_exactly_and_a_failed_side_keeps_nothing_and_the_stream_stays_in_step(tmp_path):
    from fsdpjob.orchestrator.core.runfolder.memtier import shard_name

    both = sorted([shard_name(0), shard_name(1)])
    for rank, out in enumerate(run_ranks(_round_trips, 2, base=str(tmp_path))):
        other = 1 - rank
        for size, (written, same, names) in out["sizes"].items():
            assert written == {shard_name(other): size} and same and names == both, size  # no temporary file left
        written, same, names = out["sender failed"]
        if rank == 1:  # rank 0 had nothing to send: no replica, nor a piece of one
            assert written == {} and names == [shard_name(1)]
        else:  # no own file: its write failed
            assert written == {shard_name(1): 3 * CHUNK} and same and names == [shard_name(1)]
        written, same, names = out["receiver full"]
        if rank == 1:  # received into scratch and dropped
            assert written == {} and names == [shard_name(1)]
        else:
            assert written == {shard_name(1): 3 * CHUNK + 5} and same and names == both
        assert out["after"] == ({shard_name(other): 2 * CHUNK}, True, both)


def _anon_peak_during(fn) -> tuple[object, int]:
    """``fn()``'s result and the largest RssAnon (bytes) sampled every millisecond while it ran: the process's own
    memory (a mapped tier file's pages are shared memory, not anonymous)."""
    def anon() -> int:
        return int(re.search(r"^RssAnon:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M).group(1)) * 1024

    peak, done = [anon()], threading.Event()

    def sample() -> None:
        while not done.wait(0.001):
            peak.append(anon())

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        result = fn()
    finally:
        done.set()
        sampler.join()
    return result, max(peak) - peak[0]


def _exchange_peak(rank: int, world_size: int, base: str, shard: int) -> int:
    """This rank's anonymous-memory rise over one replica exchange of a ``shard``-byte shard, in 16 MiB messages."""
    import gc

    import torch.distributed as dist

    from fsdpjob.jobs.checkpoint.memory.node import map_file
    from fsdpjob.jobs.checkpoint.memory.replicate import replicate
    from fsdpjob.orchestrator.core.runfolder.memtier import shard_name

    node = _node(rank, world_size, base)
    warm, step_dir = node.folder / "warm", node.folder / "step"
    for folder in (warm, step_dir):
        folder.mkdir(parents=True)
    replicate(node, warm, map_file(warm / shard_name(rank), 4))  # the group's first exchange sets things up
    own = map_file(step_dir / shard_name(rank), shard)
    own.fill_(rank + 1)
    gc.collect()
    dist.barrier()
    written, rise = _anon_peak_during(lambda: replicate(node, step_dir, own, chunk_bytes=16 * MiB))
    assert written == {shard_name(1 - rank): shard}
    assert (step_dir / shard_name(1 - rank)).read_bytes() == bytes([2 - rank]) * shard
    dist.destroy_process_group()
    return rise


@pytest.mark.slow
def test_the_replica_exchange_allocates_no_buffer_of_the_shards_size(tmp_path):
    """Reading the shard whole, copying it for the send and receiving the buddy's whole once held 3 shards (384 MiB
    here) during every snapshot, then two 16 MiB message buffers; now the messages are slices of the two files'
    mappings and the process's own memory does not grow by a message."""
    shard = 128 * MiB
    rises = run_ranks(_exchange_peak, 2, base=str(tmp_path), shard=shard)
    for rise in rises:
        assert rise < 16 * MiB, [f"{r / MiB:.1f} MiB" for r in rises]
