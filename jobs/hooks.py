"""Test and fault-injection hooks of the worker, read once from the environment; unset in real runs.

- ``FSDPJOB_STOP_AT_STEP=<n>``: rank 0 requests a stop after step n, as if a stop signal had come.
- ``FSDPJOB_STOP_IN_REFERENCE=<k>``: rank 0 requests a stop once chunk k of a preference run's reference pass is
  written (jobs/preference/reference.py), as if a stop signal had come.
- ``FSDPJOB_MIN_CHUNK_S=<s>``: in the job's first allocation, each chunk of the reference pass lasts at least this
  long (a test preempts the job inside the pass).
- ``FSDPJOB_LOG_SAMPLES=1``: append each step's global sample ids to samples.jsonl (proves a resume skips
  and repeats none).
- ``FSDPJOB_FAULT_SAVE_PAUSE_S=<s>``: ranks sleep that long in a checkpoint save right after their shard
  file is written and before they report it, so a test can kill a rank mid-save (``wrap_writer`` wraps the
  production writer, io.plain_writer, to do it).
  ``FSDPJOB_FAULT_SAVE_RANK=<r>`` limits it to one rank, ``FSDPJOB_FAULT_SAVE_STEP=<n>`` to one step.
  Each pause logs ``fault injection: rank R pausing ...``.
- ``FSDPJOB_FAULT_DATA_HANG_STEP=<n>``: before training step n+1, rank ``FSDPJOB_FAULT_DATA_HANG_RANK`` (default 0)
  sleeps forever where it fetches its batch (a rank stuck in the data path).
- ``FSDPJOB_FAULT_STOP_STEP=<n>``: after training step n, before that step's checkpoint, rank
  ``FSDPJOB_FAULT_STOP_RANK`` (default 0) sends itself SIGSTOP (a frozen process, heartbeat thread included)
  while the others go on into the save.
- ``FSDPJOB_FAULT_EXIT_STEP=<n>``: after training step n (and its memory-tier snapshot's start), every rank
  leaves with os._exit(70): a crash of the whole world with no handler, no save and no clean-up run.
- ``FSDPJOB_FAULT_LOAD_EXIT_LAUNCH=<n>``: in launch n (a restart), rank ``FSDPJOB_FAULT_LOAD_EXIT_RANK`` (default
  0) leaves with os._exit(70) in the middle of its resume's checkpoint load (``in_resume``): a second fault while
  the workers recover from a first.
- ``FSDPJOB_MIN_STEP_S=<s>``: in the job's first allocation (Slurm's restart count 0), every rank makes each
  training step last at least this long (it sleeps out the rest): a time-limit test's run then cannot finish
  inside its first allocation on any machine, and the next allocation, unpaced, trains the rest at the
  machine's own speed instead of needing four more on a slow one. ``FSDPJOB_MIN_STEP_S_ALLOCATIONS=<k>``
  (default 1) paces the first k allocations instead (restart counts 0 to k - 1): a fault a test sends in a
  requeued allocation then lands mid-run however fast the machine trains.
- ``FSDPJOB_SKIP_FINAL_SAVE=1``: no checkpoint at the end of training (bench/gpu.py: a 13 GB write per case
  that is not what it measures).
The fault hooks but the load exit act only on the first launch of an allocation (FSDPJOB_LAUNCH 0): the
supervisor's restart then runs clean, as after a real transient fault.

The training loop calls them at two points of a step (``StepHooks.before_step``, ``StepHooks.after_step``); the
saver reads the stop-at-step request where it agrees on a stop, the exit between its two tiers and the skipped
final save.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from fsdpjob.orchestrator.core import envvars
from fsdpjob.orchestrator.core.runfolder import heartbeat

from .checkpoint.manager import WriterFactory
from .workerenv import WorkerEnv

log = logging.getLogger("fsdpjob.checkpoint")


def _int_or_none(name: str) -> int | None:
    raw = envvars.get(name)
    return int(raw) if raw else None


def _number(name: str) -> float:
    return float(envvars.get(name) or 0)


@dataclass(frozen=True)
class TestHooks:
    """The hooks in force for this process (see the module docstring); the defaults do nothing."""

    __test__ = False  # not a pytest test class, whatever imports it

    stop_at_step: int = 0
    stop_in_reference: int | None = None
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
    min_chunk_s: float = 0.0
    exit_step: int | None = None
    load_exit_launch: int | None = None
    load_exit_rank: int = 0

    def after_reference_chunk(self, index: int, stop, is_main: bool) -> None:
        """After chunk ``index`` of the reference pass is written: the stop request and the pacing hooks."""
        if self.min_chunk_s:
            time.sleep(self.min_chunk_s)
        if index == self.stop_in_reference and is_main:
            stop.request()

    @classmethod
    def from_env(cls) -> TestHooks:
        worker = WorkerEnv.from_env()
        faults = worker.launch == 0
        return cls(
            stop_at_step=_int_or_none("FSDPJOB_STOP_AT_STEP") or 0,
            stop_in_reference=_int_or_none("FSDPJOB_STOP_IN_REFERENCE"),
            log_samples=envvars.get("FSDPJOB_LOG_SAMPLES") is not None,  # any value, not only '1'
            save_pause_s=_number("FSDPJOB_FAULT_SAVE_PAUSE_S") if faults else 0.0,
            save_pause_rank=_int_or_none("FSDPJOB_FAULT_SAVE_RANK"),
            save_pause_step=_int_or_none("FSDPJOB_FAULT_SAVE_STEP"),
            data_hang_step=_int_or_none("FSDPJOB_FAULT_DATA_HANG_STEP") if faults else None,
            data_hang_rank=_int_or_none("FSDPJOB_FAULT_DATA_HANG_RANK") or 0,
            stop_step=_int_or_none("FSDPJOB_FAULT_STOP_STEP") if faults else None,
            stop_rank=_int_or_none("FSDPJOB_FAULT_STOP_RANK") or 0,
            skip_final_save=envvars.is_on("FSDPJOB_SKIP_FINAL_SAVE"),
            min_step_s=(_number("FSDPJOB_MIN_STEP_S")
                        if worker.restart_count < (_int_or_none("FSDPJOB_MIN_STEP_S_ALLOCATIONS") or 1) else 0.0),
            min_chunk_s=_number("FSDPJOB_MIN_CHUNK_S") if worker.restart_count == 0 else 0.0,
            exit_step=_int_or_none("FSDPJOB_FAULT_EXIT_STEP") if faults else None,
            # A fault of a restart, by its launch number: the others fire on launch 0 only.
            load_exit_launch=_int_or_none("FSDPJOB_FAULT_LOAD_EXIT_LAUNCH"),
            load_exit_rank=_int_or_none("FSDPJOB_FAULT_LOAD_EXIT_RANK") or 0,
        )

    def at(self, *, rank: int, world_size: int, run_dir: Path, train_rows: torch.Tensor | None) -> StepHooks:
        """These hooks at the points of a training step on this rank (``train_rows``: see log_step_samples)."""
        return StepHooks(self, rank, world_size, run_dir / "samples.jsonl" if self.log_samples else None, train_rows)

    def wrap_writer(self, make: WriterFactory) -> WriterFactory:
        """``make`` (the production writer factory, checkpoint/io.plain_writer), with the save pause where it
        applies: the writer it returns sleeps after writing this rank's shard, before DCP reports it."""
        def pausing(step_dir: Path, *, rank: int, step: int) -> Any:
            writer = make(step_dir, rank=rank, step=step)
            if self.save_pause_s > 0 and self.save_pause_rank in (None, rank) and self.save_pause_step in (None, step):
                _pause_after_write(writer, self.save_pause_s, rank=rank, step=step)
            return writer
        return pausing

    def pace(self, started: float) -> None:
        """Sleep out the rest of ``min_step_s`` of a step that began at ``started`` (time.monotonic())."""
        if (left := self.min_step_s - (time.monotonic() - started)) > 0:
            time.sleep(left)

    def maybe_hang_in_data(self, step: int, rank: int) -> None:
        # Its name is what a stack dump shows (tests/test_recovery_local.py looks for it).
        if self.data_hang_step == step and self.data_hang_rank == rank:
            log.warning("fault injection: rank %d hanging in the data path before step %d", rank, step + 1)
            while True:
                time.sleep(3600)

    def maybe_exit(self, step: int) -> None:
        """After ``step``'s memory-tier snapshot started, before its durable save (the saver calls it)."""
        if self.exit_step == step:
            log.warning("fault injection: exiting (os._exit) after step %d", step)
            logging.shutdown()
            os._exit(70)

    def in_resume(self, source: Any, *, launch: int, rank: int) -> Any:
        """``source`` (a ResumeSource, or None) whose loads make this rank exit at once in the middle of the resume,
        after the first load (the counters, read through DCP) and before the second (the whole state), where the
        load-exit hook names this launch and rank: a second fault while a restart recovers."""
        if source is None or self.load_exit_launch != launch or self.load_exit_rank != rank:
            return source
        loads = []

        def load(state: dict[str, Any]) -> Any:
            if loads:
                log.warning("fault injection: rank %d exiting (os._exit) in launch %d's checkpoint load", rank, launch)
                logging.shutdown()
                os._exit(70)
            loads.append(state)
            return source.load(state)

        return dataclasses.replace(source, load=load)

    def maybe_freeze(self, step: int, rank: int) -> None:
        if self.stop_step == step and self.stop_rank == rank:
            log.warning("fault injection: rank %d freezing itself (SIGSTOP) after step %d", rank, step)
            # The last beat says exactly where it froze (phase and step), not the thread's sample up to 1 s before:
            # the tests assert both (issue 55).
            heartbeat.beat_now()
            os.kill(os.getpid(), signal.SIGSTOP)


def _pause_after_write(writer: Any, pause_s: float, *, rank: int, step: int) -> None:
    """Make ``writer.write_data`` sleep ``pause_s`` once its shard is written. On the instance, not a subclass: the
    production writer stays what checkpoint/ chose, whatever its class."""
    write = writer.write_data

    def write_data(plan: Any, planner: Any) -> Future:
        written = write(plan, planner)
        log.warning("fault injection: rank %d pausing %.1f s in step %d", rank, pause_s, step)
        time.sleep(pause_s)
        return written

    writer.write_data = write_data


@dataclass(frozen=True)
class StepHooks:
    """The test hooks at the two points of a training step on one rank (TestHooks.at)."""

    __test__ = False

    hooks: TestHooks
    rank: int
    world_size: int
    samples_file: Path | None  # with log_samples
    train_rows: torch.Tensor | None

    def before_step(self, step: int) -> None:
        """Before step ``step + 1`` fetches its batch: the data-path hang."""
        self.hooks.maybe_hang_in_data(step, self.rank)

    def after_step(self, step: int, micro_batches: Sequence[Any], started: float) -> None:
        """After ``step`` trained and was logged, before its evaluation and saves: the sample ids, the pace (the
        step began at ``started``, time.monotonic()), the freeze."""
        if self.samples_file is not None:
            self.log_step_samples(step, micro_batches)
        self.hooks.pace(started)
        self.hooks.maybe_freeze(step, self.rank)

    def log_step_samples(self, step: int, micro_batches: Sequence[Any]) -> None:
        """Append the global sample ids of this step (all ranks) to samples.jsonl: proves none skipped or repeated.
        With data.eval_fraction (``train_rows``), also the rows of the packed data they were (``rows``): proves
        none was held out. Collective."""
        rows_of = self.train_rows
        local = [int(i) for mb in micro_batches for i in mb.sample_ids]
        rows = [int(rows_of[i]) for mb in micro_batches for i in mb.sequence_ids] if rows_of is not None else []
        gathered: list = [None] * self.world_size
        dist.all_gather_object(gathered, (local, rows))
        if self.rank == 0:
            record = {"step": step, "world_size": self.world_size, "ids": sorted(sum((g[0] for g in gathered), []))}
            if rows_of is not None:
                record["rows"] = sorted(sum((g[1] for g in gathered), []))
            with open(self.samples_file, "a", encoding="utf-8") as f:
                f.write(json.dumps(record) + "\n")
