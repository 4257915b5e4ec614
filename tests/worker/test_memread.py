"""A resume's fetch from the memory tier (jobs/checkpoint/memread.fetcher) on two real gloo ranks as two nodes: the
byte ranges a rank lacks arrive exactly, whatever their sizes around a message's edges (a range split over several
messages, several ranges in one), and the ranks hold one message buffer each, never a copy of what travels."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from distributed import run_ranks

pytestmark = pytest.mark.distributed

CHUNK = 1000
MiB = 2**20
# (offset, length): one byte, a range across a message's edge, one exactly a message, one of several messages, an
# empty item (a 0-element tensor)
RANGES = [(0, 1), (7, 998), (2000, 1000), (4000, 3 * CHUNK + 5), (7900, 0)]


def _content(size: int) -> bytes:
    return bytes((i * 31 + 7) % 251 for i in range(size))


def _status_kib(field: str) -> int:
    return int(re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M).group(1))


def _fetch(rank: int, world_size: int, base: str, size: int, ranges: list, chunk: int, peak: bool) -> dict:
    """Rank 0's node holds the file; rank 1 fetches ``ranges`` of it. Returns what rank 1 got and the rise."""
    import gc

    import torch.distributed as dist

    from fsdpjob.jobs.checkpoint.memory.node import TierNode
    from fsdpjob.jobs.checkpoint.memory.read import fetcher
    from fsdpjob.orchestrator.core.runfolder.memtier import TierChoice, TierKey

    os.environ["SLURMD_NODENAME"] = f"n{rank + 1}"
    dist.init_process_group("gloo")
    node = TierNode(base, TierKey("job", 0, "spec"), rank=rank, world_size=world_size)
    step_dir, work = node.folder / "step", node.folder / f"load-{rank}"
    step_dir.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True)
    if rank == 0:
        with open(step_dir / "shard", "wb") as f:  # a MiB at a time: the file is never in the process
            for start in range(0, size, MiB):
                f.write(_content(min(MiB, size - start)))
    choice = TierChoice(step=1, world_size=2, holders={"shard": [0]}, metadata_holders=[0])
    fetch = fetcher(node, choice, step_dir, chunk_bytes=chunk)
    fetch(work, {"shard": ranges} if rank == 1 else {})  # the warm-up, or the test
    if peak:
        gc.collect()
        dist.barrier()
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS (Linux)
        before = _status_kib("VmRSS")
        fetch(work, {"shard": ranges} if rank == 1 else {})
        rise = (_status_kib("VmHWM") - before) * 1024
    got = {}
    if rank == 1 and not peak:
        with open(work / "shard", "rb") as f:
            for offset, length in ranges:
                f.seek(offset)
                got[offset] = f.read(length)
    dist.destroy_process_group()
    return {"got": got, "rise": rise if peak else None}


def test_the_fetched_ranges_arrive_exactly_across_message_edges(tmp_path):
    size = 8000
    out = run_ranks(_fetch, 2, base=str(tmp_path), size=size, ranges=RANGES, chunk=CHUNK, peak=False)
    content = _content(size)
    for offset, length in RANGES:
        assert out[1]["got"][offset] == content[offset:offset + length], (offset, length)


@pytest.mark.slow
def test_a_fetch_holds_one_message_buffer_per_rank_never_a_copy_of_what_travels(tmp_path):
    """Reading the ranges whole, joining them for the send and receiving them whole held 3 copies (384 MiB here) on
    the sending rank; the stream holds one message buffer per rank (16 MiB)."""
    size, chunk = 128 * MiB, 16 * MiB
    out = run_ranks(_fetch, 2, base=str(tmp_path), size=size, ranges=[(0, size)], chunk=chunk, peak=True)
    for rank in out:
        assert rank["rise"] < chunk + 16 * MiB < size, [f"{r['rise'] / MiB:.1f} MiB" for r in out]
