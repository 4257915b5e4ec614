"""Async saves stage off the training loop: the copy of the state into host buffers runs in the background and
the next optimizer step, the first thing that changes the saved tensors, waits for it.

A synchronous copy blocked the loop for the whole copy, and the first async save also for allocating and
faulting in the staging memory (bench/checkpoint_io.py: up to half a sync save's time for 2.25 GB per rank).
Now save() returns once the small entries are captured; the forward and backward of the next step (which only
read the sharded parameters and write gradients, which are not saved) overlap the copy, and the optimizer's
step pre-hook waits for whatever is left. Everything but the model and optimizer tensors (LR scheduler, data
position, counters, RNG) is copied before save() returns, so nothing in it can change under the copy.
"""

from __future__ import annotations

import concurrent.futures
import copy
import time
from typing import Any

import torch
from torch.distributed.checkpoint.stateful import Stateful

from fsdpjob.orchestrator.core.workertorch import ASYNC_SAVE, release

from .io import fast_io
from .state import ModelOptimState


def snapshot(state: dict[str, Any]) -> dict[str, Any]:
    """The state to hand to an async save: model and optimizer as they are (staged in the background, behind the
    gate), every other entry as a deep copy of its state dict now."""
    return {
        key: value if isinstance(value, ModelOptimState)
        else copy.deepcopy(value.state_dict() if isinstance(value, Stateful) else value)
        for key, value in state.items()
    }  # fmt: skip


class StagingGate:
    """Makes the next step of the state's optimizers wait until ``staged`` (the background copy) is done.

    The hook stays registered (removing it while the optimizer iterates its hooks would break that loop) and
    does nothing once the copy is done; release() removes it. ``waited_s``: how long a step waited for the copy,
    the part of the copy that still blocked the loop.
    """

    def __init__(self, state: dict[str, Any], staged: concurrent.futures.Future) -> None:
        self.waited_s = 0.0
        self._staged: concurrent.futures.Future | None = staged
        optimizers = [v.optimizer for v in state.values() if isinstance(v, ModelOptimState)]
        self._handles = [opt.register_step_pre_hook(self._before_step) for opt in optimizers]

    def _before_step(self, *_: Any) -> None:
        if self._staged is None:
            return
        started = time.monotonic()
        # A failed copy fails the save: the manager's wait() raises it, the step need not.
        concurrent.futures.wait([self._staged])
        self.waited_s += time.monotonic() - started
        self._staged = None

    @property
    def passed(self) -> bool:
        """Whether a step has gone through the gate (waited_s is then final)."""
        return self._staged is None

    def release(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def check_async_save_torch(version: str) -> None:
    """Fail at set-up, not at the first save, where this torch has no DefaultStager (torch < 2.9; validate refuses
    it already where it knows the workers' torch: core/workertorch.py)."""
    if release(version) < ASYNC_SAVE.release:
        need = ".".join(map(str, ASYNC_SAVE.release))
        raise RuntimeError(f"checkpoint.async_save needs torch >= {need} (DCP's DefaultStager); this worker has torch "
                           f"{version}: install torch >= {need} or set checkpoint.async_save: false")


def bind_cuda_device(device: int | None) -> None:
    """Make ``device`` this thread's current CUDA device. A new thread starts on device 0: the first CUDA call there
    (cudaHostRegister for pinned buffers, current_stream() in DCP's loader) would create a second context on GPU 0
    for every local rank but 0."""
    if device is not None:
        torch.cuda.set_device(device)


def stage_in_background(cuda: bool) -> Any:
    """DCP's stager for async saves: copies into buffers kept between saves (pinned on CUDA, so later saves only
    copy), in a background thread; FSDPJOB_CHECKPOINT_IO=stock keeps the copy in save(), as before. On CUDA the
    copies run non-blocking on the stager's own stream, after an event recorded on the compute stream at save()
    (the step that produced the tensors), so they overlap the next step's kernels instead of queueing among them."""
    check_async_save_torch(torch.__version__)
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    class DeviceStager(DefaultStager):
        """DefaultStager whose thread is on this rank's device and whose copy stream waits for the compute stream."""

        def __init__(self, options: StagingOptions) -> None:
            super().__init__(options)
            self._device = torch.cuda.current_device() if cuda else None
            self._ready: Any = None
            if self._staging_executor is not None:
                self._staging_executor.submit(bind_cuda_device, self._device).result()

        def stage(self, state_dict: Any, **kwargs: Any) -> Any:
            if self._staging_stream is not None:
                self._ready = torch.Event()
                self._ready.record()  # on the caller's (compute) stream: after optimizer.step() and everything before
            return super().stage(state_dict, **kwargs)

        def _stage(self, state_dict: Any, **kwargs: Any) -> Any:
            if self._staging_stream is not None and self._ready is not None:
                self._staging_stream.wait_event(self._ready)
            # torch 2.11's stager deep-copies with a dispatch table that lacks classes (KeyError: <class 'type'>
            # on an H200 at the second async save; 2.13 has the entry): a class is copied as itself, as
            # copy.deepcopy does. Its copiers are called with non_blocking= as well.
            dispatch = getattr(getattr(self, "_state_dict_stager", None), "_deepcopy_dispatch", None)
            if isinstance(dispatch, dict):
                dispatch.setdefault(type, _as_itself)
            return super()._stage(state_dict, **kwargs)

    background = fast_io()
    return DeviceStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=False, use_async_staging=background,
                                       use_non_blocking_copy=cuda and background))  # fmt: skip


def _as_itself(value: Any, memo: Any, **_copy_options: Any) -> Any:
    return value


def start_async_save(state: dict[str, Any],
                     **save_options: Any) -> tuple[concurrent.futures.Future, StagingGate | None]:
    """dcp.async_save of ``state``: the write's future, and the gate the next optimizer step waits at (None when the
    stager copied synchronously)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

    response = dcp.async_save(snapshot(state), **save_options)
    if isinstance(response, AsyncSaveResponse):
        return response.upload_completion, StagingGate(state, response.staging_completion)
    return response, None
