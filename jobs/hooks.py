"""Test and fault-injection hooks of the worker, read once from the environment; unset in real runs.

- ``FSDPJOB_STOP_AT_STEP=<n>``: rank 0 requests a stop after step n, as if a stop signal had come.
- ``FSDPJOB_LOG_SAMPLES=1``: append each step's global sample ids to samples.jsonl (proves a resume skips
  and repeats none).
- ``FSDPJOB_FAULT_SAVE_PAUSE_S=<s>``: ranks sleep that long in a checkpoint save right after their shard
  file is written and before they report it, so a test can kill a rank mid-save.
  ``FSDPJOB_FAULT_SAVE_RANK=<r>`` limits it to one rank, ``FSDPJOB_FAULT_SAVE_STEP=<n>`` to one step.
  Each pause logs ``fault injection: rank R pausing ...``.
- ``FSDPJOB_FAULT_DATA_HANG_STEP=<n>``: before training step n+1, rank ``FSDPJOB_FAULT_DATA_HANG_RANK`` (default 0)
  sleeps forever where it fetches its batch (a rank stuck in the data path).
- ``FSDPJOB_FAULT_STOP_STEP=<n>``: after training step n, before that step's checkpoint, rank
  ``FSDPJOB_FAULT_STOP_RANK`` (default 0) sends itself SIGSTOP (a frozen process, heartbeat thread included)
  while the others go on into the save.
- ``FSDPJOB_FAULT_EXIT_STEP=<n>``: after training step n (and its memory-tier snapshot's start), every rank
  leaves with os._exit(70): a crash of the whole world with no handler, no save and no clean-up run.
- ``FSDPJOB_MIN_STEP_S=<s>``: every rank makes each training step last at least this long (it sleeps out the
  rest), so a test's step rate does not depend on how fast the machine is (a time-limit test needs a run
  that cannot finish inside one allocation, and should not need five on a slow machine).
- ``FSDPJOB_SKIP_FINAL_SAVE=1``: no checkpoint at the end of training (bench/gpu.py: a 13 GB write per case
  that is not what it measures).
The fault hooks act only on the first launch of an allocation (FSDPJOB_LAUNCH 0): the supervisor's restart
then runs clean, as after a real transient fault.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .checkpoint.io import CheckpointWriter
from .workerenv import WorkerEnv

log = logging.getLogger("fsdpjob.checkpoint")


def _int_or_none(raw: str | None) -> int | None:
    return int(raw) if raw else None


@dataclass(frozen=True)
class TestHooks:
    """The hooks in force for this process (see the module docstring); the defaults do nothing."""

    __test__ = False  # not a pytest test class, whatever imports it

    stop_at_step: int = 0
    log_samples: bool = False
    save_pause_s: float = 0.0
    save_pause_rank: int | None = None  # None: every rank
    save_pause_step: int | None = None  # None: every step
    data_hang_step: int | None = None
    data_hang_rank: int = 0
    stop_step: int | None = None
    stop_rank: int = 0
    skip_final_save: bool = False
    min_step_s: float = 0.0
    exit_step: int | None = None

    @classmethod
    def from_env(cls) -> TestHooks:
        env = os.environ
        faults = WorkerEnv.from_env().launch == 0
        return cls(
            stop_at_step=int(env.get("FSDPJOB_STOP_AT_STEP") or 0),
            log_samples=bool(env.get("FSDPJOB_LOG_SAMPLES")),
            save_pause_s=float(env.get("FSDPJOB_FAULT_SAVE_PAUSE_S") or 0) if faults else 0.0,
            save_pause_rank=_int_or_none(env.get("FSDPJOB_FAULT_SAVE_RANK")),
            save_pause_step=_int_or_none(env.get("FSDPJOB_FAULT_SAVE_STEP")),
            data_hang_step=_int_or_none(env.get("FSDPJOB_FAULT_DATA_HANG_STEP")) if faults else None,
            data_hang_rank=int(env.get("FSDPJOB_FAULT_DATA_HANG_RANK") or 0),
            stop_step=_int_or_none(env.get("FSDPJOB_FAULT_STOP_STEP")) if faults else None,
            stop_rank=int(env.get("FSDPJOB_FAULT_STOP_RANK") or 0),
            skip_final_save=env.get("FSDPJOB_SKIP_FINAL_SAVE") == "1",
            min_step_s=float(env.get("FSDPJOB_MIN_STEP_S") or 0),
            exit_step=_int_or_none(env.get("FSDPJOB_FAULT_EXIT_STEP")) if faults else None,
        )

    def pace(self, started: float) -> None:
        """Sleep out the rest of ``min_step_s`` of a step that began at ``started`` (time.monotonic())."""
        if (left := self.min_step_s - (time.monotonic() - started)) > 0:
            time.sleep(left)

    def maybe_hang_in_data(self, step: int, rank: int) -> None:
        if self.data_hang_step == step and self.data_hang_rank == rank:
            log.warning("fault injection: rank %d hanging in the data path before step %d", rank, step + 1)
            while True:
                time.sleep(3600)

    def maybe_exit(self, step: int) -> None:
        if self.exit_step == step:
            log.warning("fault injection: exiting (os._exit) after step %d", step)
            logging.shutdown()
            os._exit(70)

    def maybe_freeze(self, step: int, rank: int) -> None:
        if self.stop_step == step and self.stop_rank == rank:
            log.warning("fault injection: rank %d freezing itself (SIGSTOP) after step %d", rank, step)
            os.kill(os.getpid(), signal.SIGSTOP)

    def storage_writer(self, step_dir: Path, *, rank: int, step: int) -> CheckpointWriter:
        """DCP's file writer for this rank's save of ``step``; one that pauses when the fault hook says so."""
        pauses = self.save_pause_s > 0 and self.save_pause_rank in (None, rank) and self.save_pause_step in (None, step)
        if pauses:
            return _PausingWriter(step_dir, pause_s=self.save_pause_s, rank=rank, step=step)
        return CheckpointWriter(str(step_dir))


class _PausingWriter(CheckpointWriter):
    """CheckpointWriter that sleeps after writing this rank's shard, before DCP reports it."""

    def __init__(self, path: Path, *, pause_s: float, rank: int, step: int) -> None:
        super().__init__(str(path))
        # Not self.rank: FileSystemWriter sets that itself in set_up_storage_writer.
        self.pause_s, self.fault_rank, self.step = pause_s, rank, step

    def write_data(self, plan: Any, planner: Any) -> Future:
        written = super().write_data(plan, planner)
        log.warning("fault injection: rank %d pausing %.1f s in step %d", self.fault_rank, self.pause_s, self.step)
        time.sleep(self.pause_s)
        return written
