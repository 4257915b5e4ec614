"""Preemption and time limits: flag-only signal handlers, what a stop was, one requeue, the exit after it.

Why not submitit's handler: it requeues and exits on rank 0 from inside the signal handler, in the middle of
a step; the other ranks then crash in a collective and no checkpoint is written. So every rank replaces it
(and the SIGTERM bypass) with a handler that only records the signal. The ranks' next flag agreement
(agreement.py) tells every rank; all ranks save one committed checkpoint; then one rank requeues and every
rank exits without returning a result (returning would make Slurm record COMPLETED and never requeue).
"""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Callable
from typing import Any, NoReturn

from fsdpjob.orchestrator.core import runlog
from fsdpjob.orchestrator.core.attempts import cap_reached
from fsdpjob.orchestrator.slurm import commands as slurm_cli

from .workerenv import WorkerEnv

log = logging.getLogger("fsdpjob.preemption")

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


def classify_stop(worker: WorkerEnv) -> str:
    """Under Slurm: 'preemption' (PreemptTime is set only then), 'requeue' (someone ran `scontrol requeue`)
    or 'time_limit'; 'signal' elsewhere. A cancel (scancel sends SIGTERM too) is told apart when requeueing.

    Remaining time is misleading during a grace period (squeue %L ignores it), so it is not used.
    """
    job_id = worker.slurm_job_id
    if not job_id or not worker.on_slurm:
        return "signal"
    try:
        info = slurm_cli.scontrol_job(job_id) or {}
    except Exception as exc:  # noqa: BLE001 - the classification is informational
        log.warning("could not ask scontrol about job %s: %s", job_id, exc)
        return "signal"
    if info.get("PreemptTime", "None") not in ("None", "", "Unknown"):
        return "preemption"
    if int(info.get("Restarts", "0") or 0) > worker.restart_count:
        return "requeue"  # an external `scontrol requeue`: Slurm counted the restart before sending SIGTERM
    return "time_limit"


# How a stop ends on every rank (rank 0 decides, the others follow its broadcast).
REQUEUED, CANCELLED, NOT_REQUEUED = 0, 1, 2


def requeue(max_requeues: int, worker: WorkerEnv) -> tuple[int, str]:
    """Rank 0 only, after every rank committed: requeue the job once. Returns (outcome, detail)."""
    if capped := cap_reached(worker.restart_count, max_requeues):
        return NOT_REQUEUED, capped
    if not worker.on_slurm:
        return REQUEUED, "local: the controller restarts the workers"
    job_id = worker.slurm_job_id
    try:
        refused = slurm_cli.requeue_unless_cancelled(job_id)
    except Exception as exc:  # noqa: BLE001 - e.g. the job is being cancelled or requeued right now
        state = _job_state(job_id)
        if state == "CANCELLED":
            return CANCELLED, f"job {job_id} was cancelled while stopping; not requeued"
        if state in ("COMPLETING", "PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED"):
            # Someone (scontrol requeue, Slurm itself at grace end) is already requeueing it.
            return REQUEUED, f"job {job_id} is already being requeued ({state})"
        return NOT_REQUEUED, f"scontrol requeue {job_id} failed ({state or 'state unknown'}): {exc}"
    if refused:
        return CANCELLED, refused
    return REQUEUED, f"requeued Slurm job {job_id}"


def _job_state(job_id: str) -> str | None:
    try:
        return slurm_cli.job_state(job_id)
    except Exception:  # noqa: BLE001
        return None


def stop_and_requeue(signum: int, step: int, *, is_main: bool, stop: StopFlag, worker: WorkerEnv, max_requeues: int,
                     save_started: float, event: Callable[..., Any], share: Callable[[int], int]) -> NoReturn:
    """After the stop checkpoint committed on every rank: rank 0 classifies the stop, requeues once (unless the
    job was cancelled or the cap is reached) and writes the stop event; ``share`` hands rank 0's outcome to
    every rank (a broadcast on the host-side group), and every rank leaves the same way."""
    outcome = REQUEUED
    if is_main:
        kind = classify_stop(worker)
        signal_to_commit = time.time() - (stop.received_at or save_started)
        outcome, detail = requeue(max_requeues, worker)
        kind = "cancelled" if outcome == CANCELLED else kind
        event(runlog.STOP, reason=kind, signal=signum, step=step, requeued=outcome == REQUEUED, detail=detail,
              save_s=round(time.time() - save_started, 3), signal_to_commit_s=round(signal_to_commit, 3))
        if outcome == NOT_REQUEUED:
            event(runlog.FAILED, reason=detail, step=step, retryable=False)
    exit_after_stop(share(outcome), worker)


def exit_after_stop(outcome: int, worker: WorkerEnv) -> NoReturn:
    """Leave without a result on every rank: Slurm then keeps the requeue (a normal return would be
    recorded COMPLETED), submitit writes no result pickle, and the local controller restarts on 144.
    A cancelled job exits 0 so that the batch script's failure policy has nothing to act on."""
    if outcome == NOT_REQUEUED:
        raise SystemExit(1)
    if outcome == CANCELLED:
        raise SystemExit(0)
    if worker.scheduler == "local":
        raise SystemExit(LOCAL_REQUEUE_EXIT_CODE)
    raise SystemExit(0)
