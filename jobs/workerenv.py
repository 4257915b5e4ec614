"""What a worker knows about the job it runs in (scheduler, job id, restarts, rank for logs, host, the
supervisor's launch), read once: the one place the worker reads the scheduler's and the supervisor's variables
(the FSDPJOB_* ones through core/envvars.py)."""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from fsdpjob.orchestrator.core import envvars, slurmenv

# No torch here: preemption.py uses this before the worker's heavy imports.


@dataclass(frozen=True)
class Executor:
    """What the submitit executor that started a worker means for it."""

    on_slurm: bool  # Slurm's variables describe the job (node list, restart count)
    restarts_on_exit_code: bool  # submitit's local controller starts the workers again on exit code 144


# submitit's SUBMITIT_EXECUTOR names, one row each: nothing else in the worker compares them.
EXECUTORS = {"slurm": Executor(on_slurm=True, restarts_on_exit_code=False),
             "local": Executor(on_slurm=False, restarts_on_exit_code=True)}
OUTSIDE_SUBMITIT = Executor(on_slurm=False, restarts_on_exit_code=False)  # torchrun, the tests


@dataclass(frozen=True)
class WorkerEnv:
    """The scheduler's view of this worker process. Its place in the process group is dist.DistEnv."""

    scheduler: str | None  # submitit's executor, "slurm" or "local"; None outside submitit (torchrun, tests)
    slurm_job_id: str | None  # as scontrol takes it (<array job>_<task> for an array task)
    local_job_id: str | None  # submitit's local executor: the controller's id
    restart_count: int  # how often Slurm has restarted the job (0 on its first run)
    log_rank: str  # the rank log lines show, known before the process group exists
    host: str
    launch: int = 0  # the in-allocation supervisor's launch number (0: first; restarts count up)
    supervised: bool = False  # started by the in-allocation supervisor (orchestrator/supervise): heartbeats on

    @classmethod
    def from_env(cls) -> WorkerEnv:
        env = os.environ
        return cls(
            scheduler=env.get("SUBMITIT_EXECUTOR") or None,
            slurm_job_id=slurmenv.job_id_from_env(),
            local_job_id=env.get("SUBMITIT_LOCAL_JOB_ID") or None,
            restart_count=slurmenv.restart_count(),
            log_rank=env.get("SLURM_PROCID") or env.get("SUBMITIT_LOCAL_GLOBALID") or env.get("RANK", "0"),
            host=os.uname().nodename,
            launch=int(envvars.get("FSDPJOB_LAUNCH") or 0),
            supervised=envvars.is_on("FSDPJOB_SUPERVISED"),
        )

    @property
    def executor(self) -> Executor:
        return EXECUTORS.get(self.scheduler or "", OUTSIDE_SUBMITIT)

    @property
    def on_slurm(self) -> bool:
        return self.executor.on_slurm

    @property
    def job_id(self) -> str | None:
        """The job id the run log records: Slurm's, else the local executor's."""
        return self.slurm_job_id or self.local_job_id


_ENTERED_AT: float | None = None  # when this process first ran fsdpjob's code (jobs/entry.py)


def entered() -> None:
    """Called first thing by the pickled job: the launch's end, as the worker sees it."""
    global _ENTERED_AT
    if _ENTERED_AT is None:
        _ENTERED_AT = time.time()


def process_started_at() -> float | None:
    """When the worker started (Unix seconds): the goodput report splits a start into the launch (batch script,
    supervisor, srun, a container runtime's start) and the worker's own set-up. The later of the process's
    creation (/proc) and the moment fsdpjob's code first ran in it: a runtime may prepare the container inside the
    task's process before it execs Python (pyxis's hooks importing an image, a wrapper that sleeps or unpacks),
    and that is launch, not set-up. None where neither is known."""
    known = [t for t in (_created_at(), _ENTERED_AT) if t is not None]
    return round(max(known), 2) if known else None


def _created_at() -> float | None:
    """When this process was created (fork), from /proc; None off Linux."""
    try:
        stat = Path("/proc/self/stat").read_text()
        ticks = int(stat.rsplit(")", 1)[1].split()[19])  # field 22, starttime, in clock ticks since boot
        # The process's age against the uptime now (10 ms steps): /proc/stat's btime is whole seconds, which put
        # the start up to a second early.
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return round(time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK")), 2)
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def leave_without_joining_writers(code: int = 1) -> None:
    """A crashing worker's exit, after its process group is aborted: at interpreter shutdown, skip the joins of
    non-daemon writer threads (DCP's async writer pool, the memory tier's copier and committer), which would hold
    the exit until an in-flight shard is written (minutes for a 70B shard) while srun waits to end the step.

    The hook runs in threading's own shutdown callbacks, which run newest first and before any join (so before
    concurrent.futures joins its workers), and after submitit has written the job's failure (the exception
    reached it first). Only the worker's entry registers it: a process that merely calls run() keeps its exit."""

    def leave() -> None:
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)

    threading._register_atexit(leave)
