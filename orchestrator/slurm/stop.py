"""The Slurm end of a stop checkpoint: what the stop was, and the one requeue (the record is the batch side's,
supervise/stopfinish.py).

The workers committed a stop checkpoint and handed the stop over (core/runfolder/stophandoff.py); the supervisor,
outside
any container, calls ``settle`` (supervise/allocation.py). Slurm tells the kind of stop only here, through
scontrol: PreemptTime is set only for a preemption, Restarts has grown before the SIGTERM of an external
`scontrol requeue`, and a time limit is what is left (the remaining time is misleading during a grace period:
squeue's %L ignores it).
"""

from __future__ import annotations

import signal
import sys

from fsdpjob.orchestrator.core.runfolder.stophandoff import CANCELLED, NOT_REQUEUED, REQUEUED, RESTARTED, Settled

from . import commands as slurm_cli

# States in which someone (scontrol requeue, Slurm itself at the end of a preemption's grace) is already
# requeueing the job: a second requeue fails, and the job comes back all the same.
TEARDOWN = "teardown"  # a SIGTERM of srun's teardown, neither a preemption nor a time limit (classify)
_BEING_REQUEUED = ("COMPLETING", "PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED")


def classify(info: dict[str, str], restart_count: int, *, signum: int | None = None,
             supervisor_signalled: bool = True) -> str:
    """'preemption', 'requeue', 'teardown' or 'time_limit' from `scontrol show job` and the stop's own facts;
    'signal' when scontrol knew nothing.

    'teardown': the ranks stopped on a SIGTERM that Slurm's controller did not send, srun's teardown of the step
    after a task's shell ended. The controller's SIGTERMs (a preemption, scancel, a requeue, the time limit's end)
    reach every step of the job, the batch step too, so the supervisor got one as well; a time limit warns first
    with the profile's signal, never SIGTERM; and the job still runs. A time limit is what is left.
    """
    if not info:
        return "signal"
    if info.get("PreemptTime", "None") not in ("None", "", "Unknown"):
        return "preemption"
    if int(info.get("Restarts", "0") or 0) > restart_count:
        return "requeue"  # an external `scontrol requeue`: Slurm counted the restart before sending SIGTERM
    if signum == signal.SIGTERM and not supervisor_signalled and info.get("JobState") == "RUNNING":
        return TEARDOWN
    return "time_limit"


def requeue(job_id: str, *, capped: str | None) -> tuple[str, str]:
    """Requeue the job once, unless it was cancelled or the cap is reached (``capped``: why): (outcome, detail)."""
    if capped:
        return NOT_REQUEUED, capped
    try:
        refused = slurm_cli.requeue_unless_cancelled(job_id)
    except Exception as exc:  # e.g. the job is being cancelled or requeued right now
        state = _job_state(job_id)
        if state == "CANCELLED":
            return CANCELLED, f"job {job_id} was cancelled while stopping; not requeued"
        if state in _BEING_REQUEUED:
            return REQUEUED, f"job {job_id} is already being requeued ({state})"
        return NOT_REQUEUED, f"scontrol requeue {job_id} failed ({state or 'state unknown'}): {exc}"
    if refused:
        return CANCELLED, refused
    return REQUEUED, f"requeued Slurm job {job_id}"


def settle(job_id: str, *, restart_count: int, capped: str | None, signum: int | None = None,
           supervisor_signalled: bool = True, restart_here: str | None = None) -> Settled:
    """Classify and requeue (once, unless cancelled or ``capped``: core/attempts.cap_reached's why): what the
    batch side records. A teardown (classify) is no reason to leave the allocation: with ``restart_here`` (why the
    supervisor may restart the workers here; None: its budget is spent) the job is not requeued and the outcome
    is RESTARTED."""
    try:
        info = slurm_cli.scontrol_job(job_id) or {}
    except Exception as exc:  # the classification is informational; the requeue still matters
        print(f"fsdpjob supervisor: could not ask scontrol about job {job_id}: {exc}", file=sys.stderr, flush=True)
        info = {}
    reason = classify(info, restart_count, signum=signum, supervisor_signalled=supervisor_signalled)
    if reason == TEARDOWN and restart_here:
        return Settled(reason, RESTARTED, f"SIGTERM from srun's teardown of the step, not from Slurm (no preemption, "
                                          f"no time limit, job {job_id} still running): {restart_here}")
    return Settled(reason, *requeue(job_id, capped=capped))


def _job_state(job_id: str) -> str | None:
    try:
        return slurm_cli.job_state(job_id)
    except Exception:  # a state squeue cannot tell is an unknown one
        return None
