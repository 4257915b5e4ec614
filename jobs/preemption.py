"""Preemption and time limits: flag-only signal handlers, the hand-off of a committed stop, the exit after it.

Why not submitit's handler: it requeues and exits on rank 0 from inside the signal handler, in the middle of
a step; the other ranks then crash in a collective and no checkpoint is written. So every rank replaces it
(and the SIGTERM bypass) with a handler that only records the signal. The ranks' next flag agreement
(agreement.py) tells every rank; all ranks save one committed checkpoint; then rank 0 hands the stop to the
supervisor and every rank exits without returning a result. Workers run no Slurm command (they may be in a
container without Slurm's binaries or munge): what the stop was and the requeue are the supervisor's
(orchestrator/slurm/stop.py).
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

from fsdpjob.orchestrator.core.runfolder import runlog, stophandoff
from fsdpjob.orchestrator.core.runfolder.attempts import cap_reached, unhealthy_streak
from fsdpjob.orchestrator.core.runfolder.stophandoff import CANCELLED, NOT_REQUEUED, REQUEUED, StopHandoff

from .workerenv import WorkerEnv

# submitit's local controller restarts tasks that exit with this code (its requeue contract).
LOCAL_REQUEUE_EXIT_CODE = 144


class StopFlag:
    """Records the first stop signal; the loop's flag agreement (agreement.py) turns it into a decision
    every rank shares. This module imports no torch: the flag is set up before the worker's heavy imports."""

    def __init__(self, signal_name: str):
        self.signum = 0
        self.received_at: float | None = None
        self.signals = {getattr(signal, f"SIG{signal_name}"), signal.SIGTERM}
        for sig in self.signals:
            signal.signal(sig, self._handle)
        # submitit logs SIGCONT (Slurm sends it with the warning signal); nothing to do for it.
        signal.signal(signal.SIGCONT, signal.SIG_DFL)

    def _handle(self, signum: int, _frame: object) -> None:
        # Only set a flag: the handler may run in the middle of a forward pass or a collective.
        if not self.signum:
            self.signum = signum
            self.received_at = time.time()

    def request(self, signum: int = signal.SIGUSR2) -> None:
        """Ask for a stop from code (tests, fault injection): same path as a signal."""
        self._handle(signum, None)


def stop_and_hand_off(signum: int, step: int, *, is_main: bool, stop: StopFlag, worker: WorkerEnv, max_requeues: int,
                      save_started: float, run_dir: Path, ending: Callable[[str], None],
                      share: Callable[[int], int]) -> NoReturn:
    """After the stop checkpoint committed on every rank. Under Slurm, rank 0 hands the stop to the supervisor
    (core/runfolder/stophandoff.py), which asks Slurm what it was and requeues the job from outside any container; every
    rank then exits 0. Locally there is nothing to ask: rank 0 records the stop and submitit's controller
    restarts the workers (or, past the cap, nobody does). ``share`` hands rank 0's outcome to every rank (a
    broadcast on the host-side group): every rank leaves the same way."""
    outcome = HANDED_OFF
    if is_main:
        now = time.time()
        handoff = StopHandoff(launch=worker.launch, step=step, signal=signum, save_s=now - save_started,
                              signal_to_commit_s=now - (stop.received_at or save_started), committed_at=now)
        if worker.on_slurm:
            stophandoff.write(run_dir, handoff)
        else:
            outcome = _stop_here(run_dir, handoff, worker, max_requeues)
        ending(runlog.STOP)  # the trackers end their run as killed; the stop event comes from whoever records it
    exit_after_stop(share(outcome), worker)


def _stop_here(run_dir: Path, handoff: StopHandoff, worker: WorkerEnv, max_requeues: int) -> int:
    """A run without a scheduler to ask (local). `fsdpjob cancel` writes its cancel event before its signal: that
    stop is recorded as a cancel and nobody restarts the workers, as the supervisor does on Slurm when sacct says
    cancelled (orchestrator/slurm/stop.py). Any other stop: the controller restarts them on
    LOCAL_REQUEUE_EXIT_CODE, up to the cap."""
    if runlog.first(runlog.read_events(run_dir), runlog.CANCEL) is not None:
        stophandoff.record_stop(run_dir, handoff, reason="cancelled", outcome=CANCELLED,
                                detail="fsdpjob cancel: the workers stopped for good")
        return CANCELLED_HERE
    streak = unhealthy_streak(runlog.timeline(run_dir), worker.restart_count, ending_in_failure=False)
    capped = cap_reached(streak, max_requeues)
    detail = capped or "local: the controller restarts the workers"
    stophandoff.record_stop(run_dir, handoff, reason="signal", outcome=NOT_REQUEUED if capped else REQUEUED,
                            detail=detail)
    return FAILED_HERE if capped else RESTART_HERE


# How every rank leaves a stop (rank 0 decides, the others follow its broadcast).
HANDED_OFF, RESTART_HERE, FAILED_HERE, CANCELLED_HERE = 0, 1, 2, 3


def exit_after_stop(outcome: int, worker: WorkerEnv) -> NoReturn:
    """Leave without a result on every rank: submitit writes no result pickle (a normal return would be recorded
    as the job's result), the supervisor reads the hand-off, and submitit's local controller restarts on 144
    (outside submitit, e.g. torchrun or the tests, whoever started the ranks starts them again); after a cancel,
    exit 0: the controller restarts nothing."""
    if outcome == FAILED_HERE:
        raise SystemExit(1)
    if outcome == RESTART_HERE and worker.executor.restarts_on_exit_code:
        raise SystemExit(LOCAL_REQUEUE_EXIT_CODE)
    raise SystemExit(0)
