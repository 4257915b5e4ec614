"""Sharded DCP checkpoints: step-N layout, crash-safe commit, collective save and resume, purge.

Layout of a checkpoint root::

    <root>/step-00000120/      DCP shards (__<rank>_0.distcp), .metadata, fsdpjob.json, COMMITTED
    <root>/latest              name of the newest committed step folder (informational)

A step counts only once ``COMMITTED`` exists. Rank 0 writes it last, after DCP's own final
collective has gathered every rank's write results (so every shard is written and fsynced), and
after the sidecar. A save killed at any point leaves a folder without the marker, which resume
never chooses and purge removes. Which step a resume may use is decided in checkpoint/verify.py; the
fault-injection pause mid-save is jobs/hooks.py's wrapper of the production writer.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException

from fsdpjob.orchestrator import __version__
from fsdpjob.orchestrator.core.fileio import write_atomic
from fsdpjob.orchestrator.core.runfolder.ckptlayout import (
    LATEST,
    MARKER,
    METADATA,
    SIDECAR,
    committed_steps,
    step_dir_name,
    uncommitted_steps,
)
from fsdpjob.orchestrator.core.runfolder.sidecar import FIELD_KEYS, FORMAT_VERSION, RunFacts, Sidecar, best_step

from .checksum import commit_sums, content_damage, drop_rank_sums, recorded_sums
from .diskfull import disk_full, is_disk_full
from .io import CheckpointReader, plain_writer
from .staging import StagingGate, stage_in_background, start_async_save
from .state import DictState, ModelOptimState, RNGState
from .verify import CheckpointError, newest_valid_steps, select_checkpoint

log = logging.getLogger("fsdpjob.checkpoint")

# Builds one rank's DCP storage writer for a save: (step folder, rank=, step=) -> writer. Production's is
# io.plain_writer; train passes it wrapped by the test hooks, which can pause mid-save (jobs/hooks.py).
WriterFactory = Callable[..., FileSystemWriter]


@contextmanager
def single_process_dcp() -> Iterator[None]:
    """Silence DCP's 'assuming single process' warning where one process is what we mean (export, world size 1)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _raise(exc: BaseException) -> None:
    raise exc


def _unreadable_sidecar(step_dir: Path, exc: Exception) -> None:
    log.warning("keep_best: cannot read the sidecar of %s (%s); it is no candidate", step_dir, exc)


def _remove_step(step_dir: Path) -> None:
    # The marker goes first, so a removal cut short leaves an uncommitted folder, never a half one.
    (step_dir / MARKER).unlink(missing_ok=True)
    shutil.rmtree(step_dir, ignore_errors=True)
    if step_dir.exists():
        log.warning("could not fully remove %s; it is uncommitted and will be retried at the next purge", step_dir)


def save_facts(step: int, state: dict[str, Any], *, reason: str, eval_loss: float | None, world_size: int,
               run: RunFacts) -> Sidecar:
    """The step's sidecar but for its timings, taken when the save starts (the state may move on during an
    async write); the memory tier (checkpoint/memory/write.py) writes the same one.

    Besides the reason and the eval loss: ``model_key``, where export finds the weights ("<model_key>.model.<hf
    name>"), and every entry of flat scalars (train counters, data position) under its own key,
    so a resume can read them before the objects that load them exist.
    """
    entries: dict[str, dict[str, Any]] = {}
    for key, value in state.items():
        flat = value.state_dict() if isinstance(value, DictState) else value
        scalars = isinstance(flat, dict) and all(isinstance(x, (int, float, str, bool)) for x in flat.values())
        if scalars and key not in FIELD_KEYS:
            # Strict JSON readers (jq, other languages) reject NaN/Infinity: leave those out.
            entries[key] = {k: v for k, v in flat.items() if not (isinstance(v, float) and not math.isfinite(v))}
    return Sidecar(
        step=step, world_size=world_size, run=run, format=FORMAT_VERSION, fsdpjob_version=__version__,
        torch_version=torch.__version__, reason=reason,
        model_key=next((k for k, v in state.items() if isinstance(v, ModelOptimState)), None),
        eval_loss=eval_loss if eval_loss is not None and math.isfinite(eval_loss) else None, state=entries,
    )


# ----------------------------------------------------------------------------------------------
# The manager: collective save/load on every rank, filesystem decisions on rank 0.


class CheckpointManager:
    """Saves and restores the training state under ``root``; every public method is called on all ranks.

    With torch.distributed initialized, the constructor is collective: it creates the gloo group
    that DCP and the checkpoint barriers use (DCP's async save deadlocks on the training group).
    ``sidecar`` holds the run's facts for every step's sidecar (train passes spec_hash, fingerprint, mesh_shape and
    model_path; a dict of them is taken too, as benches pass one); the manager adds world size, step, reason, wall
    time and versions (core/runfolder/sidecar.py).
    """

    def __init__(
        self, root: Path, *, rank: int, world_size: int, keep_last: int, async_save: bool,
        sidecar: RunFacts | Mapping[str, Any] | None = None, storage_writer: WriterFactory = plain_writer,
        keep_best: bool = False,
    ) -> None:
        if keep_last < 1:
            raise ValueError(f"checkpoint.keep_last must be at least 1 (got {keep_last})")
        self.root = Path(root)
        self.rank, self.world_size = rank, world_size
        self.keep_last, self.async_save, self.keep_best = keep_last, async_save, keep_best
        self.run = sidecar if isinstance(sidecar, RunFacts) else RunFacts.of(sidecar or {})
        self.storage_writer = storage_writer
        self._distributed = dist.is_available() and dist.is_initialized()
        self._pg = dist.new_group(backend="gloo") if self._distributed else None
        # Async saves copy the state in the background into host buffers kept between saves; the next optimizer
        # step waits for the copy (jobs/checkpoint/staging.py).
        self._stager = stage_in_background(torch.cuda.is_available()) if async_save else None
        self._gate: StagingGate | None = None
        self._gate_step: int | None = None  # the async save whose gate's wait is not yet reported
        self._pending: tuple[int, Sidecar, Future, float] | None = None
        self._commit_lock = threading.Lock()
        self._committed_steps: set[int] = set()
        self._last_step: int | None = None
        self.passed_over: list[str] = []  # the newer steps the last find_resume skipped, and why
        if rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            for _, step_dir in uncommitted_steps(self.root):
                log.info("removing uncommitted checkpoint leftover %s", step_dir)
                _remove_step(step_dir)
        self._barrier()

    # -- save ------------------------------------------------------------------------------------

    def save(self, step: int, state: dict[str, Any], *, reason: str, eval_loss: float | None = None) -> bool:
        """Save ``state`` as step ``step`` (collective). Async: returns once staged; at most one in flight.

        False when the step is already saved or was loaded: nothing is written then. ``eval_loss``, the
        evaluation of these weights, goes into the sidecar (keep_best reads it there, also after a restart).
        """
        self.wait()
        if step == self._last_step:
            log.debug("step %d is already saved or loaded; not saving it again", step)
            return False
        step_dir = self.root / step_dir_name(step)
        if self.rank == 0 and step_dir.exists():
            _remove_step(step_dir)
        self._barrier()
        writer = self.storage_writer(step_dir, rank=self.rank, step=step)
        facts = self._save_facts(step, state, reason, eval_loss)
        started = time.monotonic()
        if not self.async_save:
            try:
                with single_process_dcp():
                    dcp.save(state, storage_writer=writer, process_group=self._pg, no_dist=self._pg is None)
            except (Exception, CheckpointException) as exc:  # DCP's own is a BaseException, raised on every rank
                self._stop_if_disk_full(step, exc)
                raise
            self._last_step = step
            # dcp.save returns only after the coordinator gathered every rank's write results.
            self._decide(lambda: self._commit_and_purge(step, facts, started))
            return True
        future, self._gate = start_async_save(
            state, storage_writer=writer, async_stager=self._stager, process_group=self._pg, no_dist=self._pg is None
        )
        self._gate_step = step if self._gate is not None else None
        self._last_step = step
        log.info("checkpoint step %d: copying and writing in the background (%.2f s in the loop)", step,
                 time.monotonic() - started)
        if self.rank == 0:
            # Rank 0's save finishes only after DCP gathered every rank's write results, so its own
            # completion is the moment all shards are on disk: commit then, not at the next wait().
            future.add_done_callback(lambda f: self._commit_if_done(f, step, facts, started))
        self._pending = (step, facts, future, started)
        return True

    def staging_wait(self) -> tuple[int, float] | None:
        """(step, seconds) once for each async save whose copy a step has gone through: how long that step's
        optimizer waited for the copy (StagingGate), the part of the save the loop still blocked on."""
        gate, step = self._gate, self._gate_step
        if gate is None or step is None or not gate.passed:
            return None
        self._gate_step = None
        return step, gate.waited_s

    @property
    def in_flight(self) -> int | None:
        """Step of the async save not yet waited for (it may already be committed), if any."""
        return self._pending[0] if self._pending else None

    def wait(self) -> None:
        """Finish the in-flight async save (if any), make sure it is committed, and purge (collective)."""
        if self._pending is None:
            return
        step, facts, future, started = self._pending
        self._pending = None
        try:
            future.result()
        except (Exception, CheckpointException) as exc:  # DCP's own is a BaseException
            self._last_step = None
            self._stop_if_disk_full(step, exc)
            raise RuntimeError(f"checkpoint step {step} failed in the background: {exc}") from exc
        finally:
            if self._gate is not None:
                self._gate.release()  # the copy is over (the write waited for it)
        self._decide(lambda: self._commit_and_purge(step, facts, started, future))

    def _save_facts(self, step: int, state: dict[str, Any], reason: str, eval_loss: float | None) -> Sidecar:
        return save_facts(step, state, reason=reason, eval_loss=eval_loss, world_size=self.world_size, run=self.run)

    def _stop_if_disk_full(self, step: int, exc: BaseException) -> None:
        """A save every rank saw fail (DCP gathers the ranks' failures): where the disk is full, rank 0 removes the
        half-written step and every rank raises DiskFull (collective)."""
        if is_disk_full(exc, self.root):
            self._last_step = None
            self._decide(lambda: _raise(disk_full(self.root, self.root / step_dir_name(step), step)))

    def _commit_and_purge(self, step: int, facts: Sidecar, started: float, future: Future | None = None) -> None:
        """Rank 0, inside _decide: commit the written step (unless the async save's callback did) and purge; a full
        disk at the commit (the sidecar, the record) is every rank's DiskFull."""
        try:
            if future is None:
                self._commit(step, facts, started)
            else:
                self._commit_if_done(future, step, facts, started)
        except OSError as exc:
            if not is_disk_full(exc, self.root):
                raise
            self._last_step = None
            raise disk_full(self.root, self.root / step_dir_name(step), step) from exc
        self.purge()

    def _commit_if_done(self, future: Future, step: int, facts: Sidecar, started: float) -> None:
        if future.cancelled() or future.exception() is not None:
            return
        with self._commit_lock:
            if step not in self._committed_steps:
                self._commit(step, facts, started)

    def _commit(self, step: int, facts: Sidecar, started: float) -> None:
        step_dir = self.root / step_dir_name(step)
        seconds = time.monotonic() - started
        sidecar = replace(facts, wall_time=time.time(), save_seconds=round(seconds, 3))
        sidecar.write(step_dir)
        # The ranks' sums of their shards (taken while writing) and of the small files written here, in the
        # record that commits the step: a resume checks them before it loads (checksum.py).
        sums = commit_sums(step_dir, [METADATA, SIDECAR])
        write_atomic(step_dir / MARKER, json.dumps({"step": step, "wall_time": sidecar.wall_time,
                                                     "checksums": sums}) + "\n")
        drop_rank_sums(step_dir)
        write_atomic(self.root / LATEST, step_dir.name + "\n")
        self._committed_steps.add(step)
        size = sum(f.stat().st_size for f in step_dir.iterdir() if f.is_file())
        log.info("checkpoint %s committed (%s, %.1f MB in %.2f s)", step_dir, facts["reason"], size / 1e6, seconds)

    # -- resume ----------------------------------------------------------------------------------

    def has_committed(self) -> bool:
        """Whether the checkpoint root holds any committed step (same answer on every rank)."""
        return self._decide(lambda: bool(committed_steps(self.root)))

    def step_of(self, step_dir: Path) -> int:
        """The step a verified step folder holds (its sidecar's)."""
        step = Sidecar.read(Path(step_dir)).step
        if step is None:
            raise CheckpointError(f"{step_dir}: its sidecar records no step (no manager wrote it)")
        return step

    def latest_committed(self) -> Path | None:
        """Newest committed step folder (not verified); call after wait() so the last save is included."""
        committed = committed_steps(self.root)
        return committed[-1][1] if committed else None

    @property
    def sidecar(self) -> dict[str, Any]:
        """The run facts as a dict, for readers from before ``run`` (the worker reads ``run`` itself)."""
        return self.run.to_json()

    def find_resume(self, fingerprint: dict[str, Any] | None) -> Path | None:
        """Newest committed step that verifies, its bytes included (older ones when newer are damaged); None on a
        fresh run. ``passed_over`` then says which newer steps were skipped and why."""
        corrupt: dict[Path, str] = {}
        while True:
            found, self.passed_over = self._decide(lambda: newest_valid_steps(self.root, fingerprint, corrupt))
            if found is None:
                return None
            reason = self._content_damage(found)
            if reason is None:
                return found
            if self.rank == 0:
                log.warning("checkpoint %s is corrupted: %s; falling back to the previous committed step", found,
                            reason)
            corrupt[found] = reason

    def _content_damage(self, step_dir: Path) -> str | None:
        """Why a committed step's bytes differ from those written (its files' checksums), or None; each rank reads
        its share of the files (collective)."""
        sums = recorded_sums(step_dir) or {}
        names = sorted(sums)[self.rank::self.world_size]
        mine = content_damage(step_dir, sums, names)
        reasons: list[str | None] = [mine]
        if self._pg is not None:
            reasons = [None] * self.world_size
            dist.all_gather_object(reasons, mine, group=self._pg)
        return next((r for r in reasons if r is not None), None)

    def resume_from(self, path: Path, fingerprint: dict[str, Any] | None = None) -> Path:
        """Verified step folder from an explicit step folder, checkpoint root or run folder."""
        return self._decide(lambda: select_checkpoint(Path(path), fingerprint))

    def load(self, step_dir: Path, state: dict[str, Any], reader: Callable[[str], FileSystemReader] | None = None,
             ) -> Sidecar:
        """Load ``state`` in place from ``step_dir`` (collective, any world size); return its sidecar. ``reader``
        builds the storage reader from the folder (the memory tier's fetches what this rank's node lacks)."""
        step_dir = Path(step_dir)
        sidecar = Sidecar.read(step_dir)
        if sidecar.step is None or sidecar.world_size is None:
            raise CheckpointError(f"{step_dir}: its sidecar records no step or world size (no manager wrote it)")
        saved = set(FileSystemReader(str(step_dir)).read_metadata().state_dict_metadata)
        for name, value in state.items():
            if isinstance(value, RNGState):
                value.expect_load(saved_world_size=sidecar.world_size, step=sidecar.step)
            elif isinstance(value, DictState):
                value.expect_keys(name, saved)
        started = time.monotonic()
        with single_process_dcp():
            # Plain DCP files, read straight into the state.
            storage = (reader or CheckpointReader)(str(step_dir))
            dcp.load(state, storage_reader=storage, process_group=self._pg, no_dist=self._pg is None)
        self._last_step = sidecar.step
        log.info(
            "resumed from %s (step %d, written by %d ranks, this run has %d) in %.2f s",
            step_dir,
            sidecar.step,
            sidecar.world_size,
            self.world_size,
            time.monotonic() - started,
        )
        if self.rank == 0 and step_dir.parent.resolve() == self.root.resolve():
            self._uncommit_newer(sidecar.step)
        self._barrier()
        return sidecar

    def _uncommit_newer(self, step: int) -> None:
        # Steps newer than the one resumed from were skipped as damaged (or the user chose an older
        # one); training now diverges from them, so they must never be picked by a later resume.
        newer = [p for s, p in committed_steps(self.root) if s > step]
        for step_dir in newer:
            log.warning("uncommitting %s: this run continues from step %d instead", step_dir, step)
            (step_dir / MARKER).unlink(missing_ok=True)
        if newer:
            write_atomic(self.root / LATEST, step_dir_name(step) + "\n")

    # -- housekeeping ----------------------------------------------------------------------------

    def purge(self) -> None:
        """Rank 0: keep the newest keep_last committed steps (and with keep_best the one whose sidecar has the lowest
        eval loss); drop older ones and uncommitted leftovers."""
        if self.rank != 0:
            return
        committed = committed_steps(self.root)
        if not committed:
            return
        newest = committed[-1][0]
        in_flight = self.in_flight
        doomed = [p for _, p in committed[: -self.keep_last]]
        if self.keep_best and (best := best_step(committed, _unreadable_sidecar)) is not None:
            doomed = [p for p in doomed if p != best]
        doomed += [p for s, p in uncommitted_steps(self.root) if s < newest and s != in_flight]
        for step_dir in doomed:
            log.info("purging checkpoint %s", step_dir)
            _remove_step(step_dir)

    def close(self, *, crashed: bool = False) -> None:
        """Finish any in-flight save, free the staging buffers and the checkpoint process group (collective).
        After a crash: no wait and no barrier (a peer may be dead or stuck in a collective, and the rank must leave
        at once so that srun's --kill-on-bad-exit ends the step): the save in flight is abandoned uncommitted, and
        the process groups are aborted next (dist.close_distributed)."""
        if crashed:
            if self._gate is not None:
                self._gate.release()
                self._gate = None
            self._pending = None
            return
        try:
            self.wait()
        finally:
            if self._stager is not None:
                self._stager.close()
                self._stager = None
            if self._pg is not None:
                dist.destroy_process_group(self._pg)
                self._pg = None

    # -- collectives -----------------------------------------------------------------------------

    def _barrier(self) -> None:
        if self._pg is not None:
            dist.barrier(group=self._pg)

    def _decide(self, decide: Callable[[], Any]) -> Any:
        """Run a filesystem decision on rank 0 only and give every rank the same answer (or error)."""
        answer: list[Any] = [None]
        if self.rank == 0 or self._pg is None:
            try:
                answer[0] = ("ok", decide())
            except CheckpointError as exc:
                answer[0] = ("error", exc)
        if self._pg is not None:
            dist.broadcast_object_list(answer, src=0, group=self._pg)
        kind, value = answer[0]
        if kind == "error":
            raise value
        return value
