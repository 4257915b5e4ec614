"""What the supervisor knows and can do about the allocation it runs in, one class per backend: its node
count and job id, whether a node can be left out, which nodes are lost, the hard end of a step, what the
workers need to know of the nodes, and the end of a stop. Everything that asks Slurm something runs here, on
the batch side: the workers may run in a container without Slurm's binaries or munge."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from fsdpjob.orchestrator.core import slurmenv
from fsdpjob.orchestrator.core.errors import FsdpjobError, SlurmTimeout
from fsdpjob.orchestrator.core.rendezvous import reachable_address
from fsdpjob.orchestrator.core.runfolder import attempts, runlog, stophandoff
from fsdpjob.orchestrator.core.runfolder.stophandoff import NOT_REQUEUED, StopHandoff
from fsdpjob.orchestrator.slurm import commands as slurm_cli
from fsdpjob.orchestrator.slurm import stop as slurm_stop

from . import stopfinish
from .gpufree import QUERY as GPU_QUERY
from .gpufree import GpuWait, wait_gpus_free

PROBE_TIMEOUT_S = 15.0  # `srun --overlap -w NODE true` on a healthy node takes well under a second


@dataclass(frozen=True)
class NodeFacts:
    """What the restart decision needs to know of the nodes after a crash (supervise/policy.py), read in one go,
    while the crashed step is still being torn down: that gather was seconds of every crash's recovery."""

    lost: tuple[str, ...]  # nodes that no longer run a probe
    requeue_refuses: Callable[[tuple[str, ...]], str | None]  # why a requeue could not keep the job off nodes


def _never_refused(nodes: tuple[str, ...]) -> str | None:
    return None


@dataclass(frozen=True)
class SlurmAllocation:
    """The batch job's allocation: its nodes (the step may go on without some), probed with srun --overlap."""

    nodes: int
    job_id: str | None  # for srun --overlap (probes, stack dumps on other nodes)
    gpus_per_node: str | None = None  # the job's --gpus-per-node: the GPU-free probe asks for them the same way
    can_exclude = True
    srun_reports = True  # srun's stderr names the task that failed first (supervise/blame.py)
    ends_step_on_bad_exit = True  # srun --kill-on-bad-exit (the template's launch)

    @classmethod
    def from_env(cls) -> SlurmAllocation:
        return cls(nodes=int(os.environ.get("SLURM_JOB_NUM_NODES") or 1), job_id=slurmenv.job_id_from_env(),
                   gpus_per_node=slurmenv.gpus_per_node())

    @staticmethod
    def _node_names(excluded: tuple[str, ...] = ()) -> list[str]:
        try:
            return [n for n in slurm_cli.hostnames(os.environ.get("SLURM_JOB_NODELIST", "")) if n not in excluded]
        except FsdpjobError:
            return []

    def remove_on_nodes(self, folder: Path) -> list[str]:
        """Remove ``folder`` on every node of the allocation that still answers (the memory tier's node-local
        files, at the end); the nodes where it ran. A job at its end may refuse new steps, and a lost node holds
        nothing."""
        return self._on_every_node(["rm", "-rf", "--", str(folder)])

    def make_on_nodes(self, folder: Path) -> list[str]:
        """Create ``folder`` on every node of the allocation (a node-local folder the workers write and a container
        mounts, before the first launch); the nodes where it ran."""
        return self._on_every_node(["mkdir", "-p", "--", str(folder)])

    def _on_every_node(self, argv: list[str]) -> list[str]:
        """``argv`` once per node, one ``srun --overlap`` per node in parallel, outside any container: bounded and
        best effort (a node that does not answer is left out of the nodes returned)."""
        if self.job_id is None:
            return []
        job_id = self.job_id

        def run(node: str) -> bool:
            try:
                slurm_cli.on_node(job_id, node, argv, timeout=PROBE_TIMEOUT_S)
                return True
            except FsdpjobError:
                return False

        nodes = self._node_names()
        with ThreadPoolExecutor(max_workers=min(16, len(nodes) or 1)) as pool:
            return [n for n, ok in zip(nodes, pool.map(run, nodes)) if ok]

    def node_facts(self, excluded: tuple[str, ...]) -> NodeFacts:
        """After a crash: the nodes of the allocation that no longer run a trivial command in this job (a dead
        slurmd, a node gone), probed in parallel (srun's --kill-on-bad-exit ends every rank within a second, so
        the heartbeats alone cannot always tell which node went first), and the job's partition, read once."""
        if self.job_id is None:
            return NodeFacts((), _never_refused)
        nodes = self._node_names(excluded)
        job_id = self.job_id

        def gone(node: str) -> bool:
            try:
                slurm_cli.on_node(job_id, node, ["true"], timeout=PROBE_TIMEOUT_S)
                return False
            except SlurmTimeout:  # a late answer (a loaded node or controller) is lost only if Slurm says so
                return slurm_cli.node_not_responding(node, timeout=PROBE_TIMEOUT_S) is True
            except FsdpjobError:  # srun refused the step: the node cannot run one
                return True

        def partition() -> tuple[dict, list[str]] | None:
            try:
                info = slurm_cli.scontrol_job(job_id) or {}
                return info, slurm_cli.partition_nodes(info)
            except FsdpjobError:
                return None

        with ThreadPoolExecutor(max_workers=min(16, len(nodes) + 1)) as pool:
            known = pool.submit(partition)
            lost = tuple(n for n, dead in zip(nodes, pool.map(gone, nodes)) if dead)
            facts = known.result()
        if facts is None:
            return NodeFacts(lost, _never_refused)
        info, members = facts
        return NodeFacts(lost, lambda wanted: slurm_cli.exclusion_refusal(job_id, list(wanted), info, members))

    def wait_gpus_free(self, excluded: tuple[str, ...]) -> GpuWait:
        """Before a relaunch: each node's GPUs free of the crashed step's processes (gpufree.py), probed through
        ``srun --overlap``. The probe step asks for the job's GPUs per node: a step that asks for none sees none
        on sites that do not hand the job's GRES to every step (nvidia-smi: "No devices were found")."""
        if self.job_id is None:
            return GpuWait(0.0, {}, ())
        nodes = self._node_names(excluded)
        job_id, gpus = self.job_id, self.gpus_per_node
        return wait_gpus_free(nodes, lambda node: slurm_cli.on_node(job_id, node, ["sh", "-c", GPU_QUERY],
                                                                    timeout=PROBE_TIMEOUT_S, gpus_per_node=gpus))

    def requeue_refuses(self, nodes: tuple[str, ...]) -> str | None:
        """Why a requeue could not keep the job off ``nodes`` (its partition would keep too few others), or
        None. Asked only when the supervisor would otherwise give up on a node blamed twice."""
        if self.job_id is None:
            return None
        try:
            return slurm_cli.exclusion_refusal(self.job_id, list(nodes))
        except FsdpjobError:
            return None

    def worker_env(self) -> dict[str, str]:
        """FSDPJOB_NODE_ADDRS: the Slurm NodeAddr of each node whose name does not resolve here (Slurm node names
        need not be host names), or resolves to loopback only while the job spans nodes (a 127.0.1.1 line in
        /etc/hosts: core/rendezvous.reachable_address), so that the workers find their rendezvous host without
        scontrol and do not bind gloo to ``lo``."""
        try:
            nodes = slurm_cli.hostnames(os.environ.get("SLURM_JOB_NODELIST", ""))
        except FsdpjobError:
            return {}
        addrs = {}
        for node in nodes:
            if reachable_address(node) is not None or (len(nodes) == 1 and _resolves(node)):
                continue  # one node: loopback is where its ranks meet
            try:
                if addr := slurm_cli.node_addr(node, timeout=PROBE_TIMEOUT_S):
                    addrs[node] = addr
            except FsdpjobError:
                pass  # the worker then says that the node does not resolve
        return {"FSDPJOB_NODE_ADDRS": slurmenv.format_node_addrs(addrs)} if addrs else {}

    def finish_stop(self, run_dir: Path, handoff: StopHandoff, max_requeues: int, *, signalled: bool = True,
                    restart_here: str | None = None) -> int | None:
        """The workers committed a stop checkpoint: what it was and the requeue (slurm/stop.py), the record
        (stopfinish.py). ``signalled``: the supervisor got a signal too; ``restart_here``: why it may start the
        workers again here. None: a teardown's stop, to restart here."""
        restarts = slurmenv.restart_count()
        streak = attempts.unhealthy_streak(runlog.timeline(run_dir), restarts, ending_in_failure=False)
        settled = slurm_stop.settle(self.job_id or "", restart_count=restarts,
                                    capped=attempts.cap_reached(streak, max_requeues), signum=handoff.signal,
                                    supervisor_signalled=signalled, restart_here=restart_here)
        return stopfinish.finish_stop(run_dir, handoff, settled)

    def step_command(self, command: list[str], excluded: tuple[str, ...], nodes: int, tasks_per_node: int) -> list[str]:
        """The step's command; after nodes were lost, srun on the ones left."""
        return slurm_cli.srun_on_nodes_left(command, excluded, nodes, tasks_per_node)

    def side_step(self, argv: list[str], count: int, gpus_per_node: int = 0) -> tuple[list[str], tuple[str, ...]]:
        """``argv`` as a step of its own on the allocation's last ``count`` nodes, asking for ``gpus_per_node`` GPUs
        of each, and those nodes (the training step leaves them out)."""
        nodes = tuple(self._node_names()[-count:])
        return slurm_cli.srun_on_nodes(argv, nodes, gpus_per_node), nodes

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
    ends_step_on_bad_exit = False  # the local controller waits for every rank

    def node_facts(self, excluded: tuple[str, ...]) -> NodeFacts:
        return NodeFacts((), _never_refused)

    def wait_gpus_free(self, excluded: tuple[str, ...]) -> GpuWait:
        """Before a relaunch: this machine's GPUs free of the crashed ranks (gpufree.py); nvidia-smi from PATH."""
        def here(_node: str) -> str:
            return subprocess.run(["sh", "-c", GPU_QUERY], capture_output=True, text=True, check=True,
                                  timeout=PROBE_TIMEOUT_S).stdout

        return wait_gpus_free([socket.gethostname()], here)

    def requeue_refuses(self, nodes: tuple[str, ...]) -> str | None:
        return None  # no requeue path to compare with: a local run restarts or gives up

    def remove_on_nodes(self, folder: Path) -> list[str]:
        return []  # one node: the supervisor's own removal covers it

    def make_on_nodes(self, folder: Path) -> list[str]:
        return []  # one node: the supervisor made it

    def worker_env(self) -> dict[str, str]:
        return {}

    def finish_stop(self, run_dir: Path, handoff: StopHandoff, max_requeues: int, *, signalled: bool = True,
                    restart_here: str | None = None) -> int | None:
        """Local workers record their stops themselves (jobs/preemption.py): a hand-off here has nobody to requeue."""
        stophandoff.record_stop(run_dir, handoff, reason="signal", outcome=NOT_REQUEUED,
                                detail="no scheduler to requeue the run")
        return 1

    def step_command(self, command: list[str], excluded: tuple[str, ...], nodes: int, tasks_per_node: int) -> list[str]:
        """One machine: no node is ever left out."""
        return command

    def side_step(self, argv: list[str], count: int, gpus_per_node: int = 0) -> tuple[list[str], tuple[str, ...]]:
        """One machine: a process beside the workers, no node left out."""
        return argv, ()

    def kill_step(self, proc: subprocess.Popen, signal_group: Callable[[int], None]) -> None:
        """A local tree (controller and ranks) gets SIGKILL."""
        signal_group(signal.SIGKILL)


Allocation = SlurmAllocation | LocalAllocation
_BACKENDS: dict[str, Callable[[], Allocation]] = {"slurm": SlurmAllocation.from_env, "local": LocalAllocation}


def allocation_for(scheduler: str) -> Allocation:
    return _BACKENDS[scheduler]()


def _resolves(name: str) -> bool:
    try:
        socket.getaddrinfo(name, None)
    except socket.gaierror:
        return False
    return True
