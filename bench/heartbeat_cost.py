"""What the progress heartbeat costs a training step (issue 12):

    python bench/heartbeat_cost.py

The loop pays two calls per step (``heartbeat.at_step`` before the batch, ``heartbeat.enter`` after it);
the thread pays one small file write (write + rename) per second. Both are timed here and set against the
fastest step measured on this machine (bench/RESULTS.md: the ~0.1 M-parameter model, 2 gloo ranks, about
10 ms a step), and 100 steps of fixed Python work (~10 ms each) run with and without the heartbeat, alternating.
"""

from __future__ import annotations

import statistics
import tempfile
import time
import timeit

from fsdpjob.orchestrator.core.runfolder import heartbeat

FAST_STEP_S = 0.010


def work_per_step(step_s: float) -> int:
    """Loop iterations of pure-Python work (it holds the GIL, like Python-side training code) in ~step_s."""
    n, took = 10_000, 0.0
    while took < 0.05:
        n *= 2
        start = time.perf_counter()
        sum(range(n))
        took = time.perf_counter() - start
    return int(n * step_s / took)


def busy_steps(n: int, work: int, beat: bool) -> float:
    """Wall time of ``n`` steps of fixed work, with the heartbeat calls (and its thread running) or without."""
    start = time.perf_counter()
    for step in range(n):
        if beat:
            heartbeat.at_step(step, heartbeat.NEXT_BATCH)
            heartbeat.enter(heartbeat.STEP)
        sum(range(work))
    return time.perf_counter() - start


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        hb = heartbeat.start(tmp, rank=0, launch=0)
        calls = timeit.Timer(lambda: (heartbeat.at_step(1, heartbeat.NEXT_BATCH), heartbeat.enter(heartbeat.STEP)))
        per_step = min(calls.repeat(5, 100_000)) / 100_000
        write = min(timeit.Timer(hb._write).repeat(5, 200)) / 200
        rounds = {True: [], False: []}
        work = work_per_step(FAST_STEP_S)
        for _ in range(10):
            for beat in (False, True):
                if not beat:
                    hb.close()
                else:
                    hb = heartbeat.start(tmp, rank=0, launch=0)
                rounds[beat].append(busy_steps(100, work, beat))
        hb.close()
    on, off = statistics.median(rounds[True]), statistics.median(rounds[False])
    print(f"per-step calls: {per_step * 1e9:.0f} ns = {per_step / FAST_STEP_S:.2e} of a "
          f"{FAST_STEP_S * 1e3:.0f} ms step")
    print(f"thread write (every {heartbeat.HEARTBEAT_S:.0f} s): {write * 1e6:.0f} us = "
          f"{write / heartbeat.HEARTBEAT_S:.2e} of wall time")
    print(f"100 steps of ~{FAST_STEP_S * 1e3:.0f} ms of Python work, median of 10 alternating rounds: {off:.4f} s "
          f"without, {on:.4f} s with the heartbeat (ratio {on / off:.4f})")


if __name__ == "__main__":
    main()
