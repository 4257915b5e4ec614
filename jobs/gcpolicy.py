"""Python's garbage collector during training: between steps, at the same steps on every rank.

A training step allocates many short-lived Python objects (autograd nodes, DTensor wrappers, FSDP's hook
state), so the cyclic collector, which runs whenever allocations outnumber frees by its threshold, runs in
the middle of forward and backward; now and then a full collection walks every live object, and a worker
holds far more of them than a bare loop (transformers, datasets, pyarrow, pydantic, the run's tables). A
pause on one rank holds up every rank at the next collective. torchtitan's answer, taken here: freeze
what set-up built (gc.freeze: never scanned again), turn automatic collection off, and collect the young
generations every GC_EVERY steps and everything every FULL_EVERY steps, on every rank at the same step.
"""

from __future__ import annotations

import gc

GC_EVERY = 50
FULL_EVERY = 1000


def start() -> None:
    """After set-up, before the first step."""
    gc.collect()
    gc.freeze()
    gc.disable()


def after_step(step: int) -> None:
    if step % FULL_EVERY == 0:
        gc.collect()
    elif step % GC_EVERY == 0:
        gc.collect(1)


def stop() -> None:
    """After training (and on the way out of a failed run): the collector as Python had it."""
    gc.unfreeze()
    gc.enable()
