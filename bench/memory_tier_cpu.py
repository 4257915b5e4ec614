"""Where a memory-tier snapshot's CPU goes (bench/memory_tier.py --cpu N): N snapshots, each alone (save + wait,
no step beside it), on both gloo ranks; per snapshot and rank the process's CPU time and that of its parts, each
measured as the CPU time of the thread that runs it (time.thread_time around the function):

- ``take``: the loop's taking of the sources (the state dicts, DCP's flattening, the pickled entries; memraw.take);
- ``copy``: the copy thread allocating the rank's file and copying every tensor into its mapping (memraw.fill);
- ``replica``: sending the own file's pages and receiving the buddy's replica into its file (memreplicate.replicate,
  the tier's thread), of which ``gloo I/O`` is the gloo threads' CPU (the TCP transfer, both directions);
- what is left: the rest of save() and of the commit (the metadata, parts, markers, the older step's removal).

Wrapping functions to time them is this bench's business only: the product runs unwrapped. Nothing is asserted.
"""

from __future__ import annotations

import collections
import functools
import os
import time
from collections.abc import Callable
from typing import Any


def _threads_cpu() -> dict[tuple[str, str], float]:
    """CPU seconds of each live thread of this process, by (tid, name)."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            fields = open(f"/proc/self/task/{tid}/stat").read().rsplit(")", 1)[1].split()
            name = open(f"/proc/self/task/{tid}/comm").read().strip()
        except OSError:  # the thread ended meanwhile
            continue
        out[(tid, name)] = (int(fields[11]) + int(fields[12])) / tick
    return out


def _timing(parts: collections.Counter) -> Callable[[str, Callable], Callable]:
    def timed(name: str, fn: Callable) -> Callable:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            started = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                parts[name] += time.thread_time() - started
        return wrapper
    return timed


def instrument() -> collections.Counter:
    """Wrap the parts (before the tier is built); returns the counter they add their CPU seconds to."""
    from fsdpjob.jobs.checkpoint.memory import write

    parts: collections.Counter = collections.Counter()
    timed = _timing(parts)
    write.take = timed("take", write.take)
    write.fill = timed("copy", write.fill)
    write.replicate = timed("replica", write.replicate)
    return parts


def measure(b: Any, n: int, parts: collections.Counter) -> str:
    """``n`` snapshots after a warm-up one (which makes the launch's plan); this rank's lines."""
    import torch.distributed as dist

    b.step(1)
    b.tier.save(1, b.state)
    b.tier.wait()
    parts.clear()
    dist.barrier()
    threads, cpu, wall = _threads_cpu(), time.process_time(), time.perf_counter()
    for i in range(n):
        b.tier.save(2 + i, b.state)
        b.tier.wait()
    cpu, wall = (time.process_time() - cpu) / n, (time.perf_counter() - wall) / n
    gloo = sum(v - threads.get(k, 0.0) for k, v in _threads_cpu().items() if k[1].startswith("gloo")) / n
    rows = {"take": parts["take"] / n, "copy": parts["copy"] / n, "replica": parts["replica"] / n,
            "gloo I/O": gloo}
    rest = cpu - sum(rows.values())
    lines = [f"  rank {b.rank}: {cpu * 1000:5.0f} ms CPU per snapshot (wall {wall * 1000:.0f} ms):"]
    lines += [f"    {name:16s} {v * 1000:5.0f} ms" for name, v in rows.items()]
    lines.append(f"    {'the rest':16s} {rest * 1000:5.0f} ms")
    return "\n".join(lines)
