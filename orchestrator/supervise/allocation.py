"""What the supervisor knows and can do about the allocation it runs in, one class per backend: its node
count and job id, whether a node can be left out, which nodes are lost, and the hard end of a step."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from fsdpjob.orchestrator.core.errors import FsdpjobError
from fsdpjob.orchestrator.slurm import commands as slurm_cli

PROBE_TIMEOUT_S = 15.0  # `srun --overlap -w NODE true` on a healthy node takes well under a second


@dataclass(frozen=True)
class SlurmAllocation:
    """The batch job's allocation: its nodes (the step may go on without some), probed with srun --overlap."""

    nodes: int
    job_id: str | None  # for srun --overlap (probes, stack dumps on other nodes)
    can_exclude = True
    srun_reports = True  # srun's stderr names the task that failed first (supervise/blame.py)

    @classmethod
    def from_env(cls) -> SlurmAllocation:
        return cls(nodes=int(os.environ.get("SLURM_JOB_NUM_NODES") or 1), job_id=slurm_cli.job_id_from_env())

    def lost(self, excluded: tuple[str, ...]) -> tuple[str, ...]:
        """Nodes of the allocation that no longer run a trivial command in this job (a dead slurmd, a node
        gone), probed in parallel after a crash: srun's --kill-on-bad-exit ends every rank within a second,
        so the heartbeats alone cannot always tell which node went first."""
        if self.job_id is None:
            return ()
        try:
            nodes = [n for n in slurm_cli.hostnames(os.environ.get("SLURM_JOB_NODELIST", "")) if n not in excluded]
        except FsdpjobError:
            return ()

        def gone(node: str) -> bool:
            try:
                slurm_cli.on_node(self.job_id, node, ["true"], timeout=PROBE_TIMEOUT_S)
                return False
            except FsdpjobError:
                return True

        with ThreadPoolExecutor(max_workers=min(16, max(1, len(nodes)))) as pool:
            return tuple(n for n, dead in zip(nodes, pool.map(gone, nodes)) if dead)

    def requeue_refuses(self, nodes: tuple[str, ...]) -> str | None:
        """Why a requeue could not keep the job off ``nodes`` (its partition would keep too few others), or
        None. Asked only when the supervisor would otherwise give up on a node blamed twice."""
        if self.job_id is None:
            return None
        try:
            return slurm_cli.exclusion_refusal(self.job_id, list(nodes))
        except FsdpjobError:
            return None

    def kill_step(self, proc: subprocess.Popen, signal_group: Callable[[int], None]) -> None:
        """srun aborts its step on a second SIGINT within a second (SIGKILL to every task, frozen ones included)."""
        proc.send_signal(signal.SIGINT)
        time.sleep(0.2)
        proc.send_signal(signal.SIGINT)


@dataclass(frozen=True)
class LocalAllocation:
    """This machine: one node, nothing to leave out or probe."""

    nodes: int = 1
    job_id: str | None = None
    can_exclude = False
    srun_reports = False

    def lost(self, excluded: tuple[str, ...]) -> tuple[str, ...]:
        return ()

    def requeue_refuses(self, nodes: tuple[str, ...]) -> str | None:
        return None  # no requeue path to compare with: a local run restarts or gives up

    def kill_step(self, proc: subprocess.Popen, signal_group: Callable[[int], None]) -> None:
        """A local tree (controller and ranks) gets SIGKILL."""
        signal_group(signal.SIGKILL)


Allocation = SlurmAllocation | LocalAllocation
_BACKENDS: dict[str, Callable[[], Allocation]] = {"slurm": SlurmAllocation.from_env, "local": LocalAllocation}


def allocation_for(scheduler: str) -> Allocation:
    return _BACKENDS[scheduler]()
