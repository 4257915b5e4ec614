"""Worker process setup: who am I (rank, world, device) and the process group's life cycle."""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from fsdpjob.orchestrator.core import envvars, slurmenv
from fsdpjob.orchestrator.core.rendezvous import MASTER_PORT_VAR, is_loopback, port_for_job, reachable_address

from . import netif
from .workerenv import WorkerEnv

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class DistEnv:
    """Where this worker sits in the job, and how it reaches its peers."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    backend: str
    device: torch.device
    # The job's other nodes (Slurm launches; empty elsewhere): gloo routes towards one where the rendezvous name
    # resolves to loopback on its own node (jobs/netif.py).
    other_nodes: tuple[str, ...] = ()

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def granted_gpus(environ: Mapping[str, str]) -> str | None:
    """The variable that says Slurm (or the user) gave this task GPUs, as ``NAME=value``; None when none does."""
    for name in ("SLURM_GPUS_ON_NODE", "SLURM_STEP_GPUS", "SLURM_JOB_GPUS", "CUDA_VISIBLE_DEVICES"):
        value = environ.get(name, "").strip()
        if value and value not in ("0" if name == "SLURM_GPUS_ON_NODE" else "", "-1", "none", "NoDevFiles"):
            return f"{name}={value}"
    return None


def cuda_index(local_rank: int, visible: int, environ: Mapping[str, str]) -> int:
    """This task's device among the visible ones. Every GPU of the node visible (the rendered --gpus-per-node
    layout): the local rank. One visible (a per-task binding: --gpus-per-task=1, --gpu-bind=single:1/closest/
    map_gpu narrowed CUDA_VISIBLE_DEVICES to this task's GPU): that one. Anything else has no right answer."""
    if local_rank < visible:
        return local_rank
    if visible == 1:
        return 0
    raise RuntimeError(
        f"local rank {local_rank} has no GPU: {visible} visible (CUDA_VISIBLE_DEVICES="
        f"{environ.get('CUDA_VISIBLE_DEVICES', '(unset)')}); give every task all of the node's GPUs "
        "(no --gpus-per-task "
        "or --gpu-bind in the profile's sbatch_extra/srun_extra) or exactly one"
    )


def _backend_and_device(local_rank: int, cpu_offload: bool) -> tuple[str, torch.device]:
    if not torch.cuda.is_available():
        # FSDPJOB_FAKE_GPUS=1: the GPUs Slurm hands out are not real (the dev cluster's are /dev/null devices).
        if (granted := granted_gpus(os.environ)) and not envvars.is_on("FSDPJOB_FAKE_GPUS"):
            # A CPU-only torch (or a driver that does not match it) on a GPU node would train on the CPU over gloo.
            raise RuntimeError(
                f"this task was given GPUs ({granted}) but torch {torch.__version__} sees none (CUDA build: "
                f"{torch.version.cuda or 'none, a CPU-only wheel'}); install a CUDA torch in the job's environment or "
                "check the driver with nvidia-smi"
            )
        return "gloo", torch.device("cpu")
    # Offloaded shards live on the CPU: their collectives (e.g. the rank-0 weight broadcast) need gloo.
    backend = "cpu:gloo,cuda:nccl" if cpu_offload else "nccl"
    return backend, torch.device("cuda", cuda_index(local_rank, torch.cuda.device_count(), os.environ))


def resolve_master_addr(node: str, environ: Mapping[str, str] = os.environ) -> str:
    """``node``'s address as the supervisor resolved it on the batch side (FSDPJOB_NODE_ADDRS: Slurm node names
    need not be host names, and a worker in a container cannot ask scontrol), else ``node`` itself."""
    addrs = envvars.get("FSDPJOB_NODE_ADDRS", environ=environ)
    addr = slurmenv.node_addrs(addrs).get(node)
    if addr is not None:
        return addr
    try:
        socket.getaddrinfo(node, None)
    except socket.gaierror:
        raise RuntimeError(
            f"the job's first node {node!r} does not resolve and the supervisor passed no address for it "
            f"(FSDPJOB_NODE_ADDRS={addrs or '(unset)'}); make node names resolvable "
            "(DNS or /etc/hosts) on every node, or set NodeAddr in slurm.conf"
        ) from None
    return node


def _from_submitit(cpu_offload: bool, worker: WorkerEnv) -> DistEnv:
    import submitit

    if worker.on_slurm and os.environ.get("SLURM_STEP_NODELIST") and os.environ.get("SLURM_STEP_NUM_NODES"):
        # submitit reads the job's node list and count; a step the supervisor shrank (a node lost, see
        # orchestrator/supervise) runs on fewer: the rendezvous host and ranks per node follow the step's.
        os.environ["SLURM_JOB_NODELIST"] = os.environ["SLURM_STEP_NODELIST"]
        os.environ["SLURM_JOB_NUM_NODES"] = os.environ["SLURM_STEP_NUM_NODES"]
    job_env = submitit.JobEnvironment()
    if worker.on_slurm:
        master_addr = resolve_master_addr(job_env.hostnames[0])
    else:  # submitit's local executor: every task is on this machine
        master_addr = "127.0.0.1"
    backend, device = _backend_and_device(job_env.local_rank, cpu_offload)
    return DistEnv(
        rank=job_env.global_rank,
        world_size=job_env.num_tasks,
        local_rank=job_env.local_rank,
        local_world_size=job_env.num_tasks // job_env.num_nodes,
        master_addr=master_addr,
        # Ignore an inherited MASTER_PORT: sbatch exports the submitting shell's environment. The supervisor's
        # port, free on its node when it started this launch, else the job id's (core/rendezvous.py).
        master_port=int(envvars.get(MASTER_PORT_VAR) or port_for_job(job_env.job_id, worker.launch)),
        backend=backend,
        device=device,
        other_nodes=tuple(h for h in job_env.hostnames if h != job_env.hostnames[0]) if worker.on_slurm else (),
    )


def _int_env(name: str, default: int | None = None) -> int:
    raw = os.environ.get(name)
    if raw is None:
        if default is None:
            raise RuntimeError(f"environment variable {name} is not set")
        return default
    try:
        return int(raw)
    except ValueError:
        raise RuntimeError(f"environment variable {name}={raw!r} is not an integer") from None


def _from_plain_env(cpu_offload: bool) -> DistEnv:
    missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise RuntimeError(
            f"RANK and WORLD_SIZE are set but {' and '.join(missing)} not; set all four (as torchrun does)"
        )
    rank, world_size = _int_env("RANK"), _int_env("WORLD_SIZE")
    local_rank = _int_env("LOCAL_RANK", rank)
    backend, device = _backend_and_device(local_rank, cpu_offload)
    return DistEnv(
        rank=rank,
        world_size=world_size,
        local_rank=local_rank,
        local_world_size=_int_env("LOCAL_WORLD_SIZE", world_size),
        master_addr=os.environ["MASTER_ADDR"],
        master_port=_int_env("MASTER_PORT"),
        backend=backend,
        device=device,
    )


def detect_env(cpu_offload: bool = False, worker: WorkerEnv | None = None) -> DistEnv:
    """Read the job layout: a submitit job, else torchrun-style RANK/WORLD_SIZE, else one process."""
    worker = worker or WorkerEnv.from_env()
    if worker.scheduler:
        return _from_submitit(cpu_offload, worker)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return _from_plain_env(cpu_offload)
    backend, device = _backend_and_device(0, cpu_offload)
    # Port 0: a single process rendezvous through an in-memory store, no socket.
    return DistEnv(0, 1, 0, 1, "127.0.0.1", 0, backend, device)


def init_distributed(timeout_s: int, *, cpu_offload: bool = False, worker: WorkerEnv | None = None) -> DistEnv:
    """Create the default process group (also for one process, so FSDP2 and DCP behave the same everywhere).

    The explicit timeout bounds the rendezvous too: an unreachable MASTER_ADDR fails after ``timeout_s``
    instead of hanging.
    """
    worker = worker or WorkerEnv.from_env()  # read once: the layout and the store's prefix both need it
    env = detect_env(cpu_offload, worker)
    options: dict = {"rank": env.rank, "world_size": env.world_size, "timeout": timedelta(seconds=timeout_s)}
    if env.device.type == "cuda":
        torch.cuda.set_device(env.device)
        options["device_id"] = env.device  # NCCL connects now, so a broken setup fails here, not at step 1
    if env.world_size == 1 and env.master_port == 0:
        dist.init_process_group(env.backend, store=dist.HashStore(), **options)
    else:
        os.environ.update(MASTER_ADDR=env.master_addr, MASTER_PORT=str(env.master_port))
        # every run has gloo groups (control, export, checkpoint)
        _choose_gloo_interface(env.master_addr, env.other_nodes)
        dist.init_process_group(env.backend, store=_rendezvous_store(env, timeout_s, worker), **options)
    log.info(
        "process group up: rank %d/%d (local %d/%d), backend %s, device %s, master %s:%d",
        *(env.rank, env.world_size, env.local_rank, env.local_world_size),
        *(env.backend, env.device, env.master_addr, env.master_port),
    )
    return env


def _rendezvous_store(env: DistEnv, timeout_s: int, worker: WorkerEnv) -> dist.Store:
    """Rank 0's TCPStore at MASTER_ADDR:MASTER_PORT (as init_method env:// makes it), seen through a prefix of
    this launch's own: ranks of another job that reach the same port (two jobs on one node that drew it, the
    other's rank 0 then failing to bind) read and write other keys and never join this launch's world."""
    store = dist.TCPStore(env.master_addr, env.master_port, env.world_size, is_master=env.rank == 0,
                          timeout=timedelta(seconds=timeout_s), wait_for_workers=False, multi_tenant=True)
    return dist.PrefixStore(f"fsdpjob/{worker.job_id or 'local'}/{worker.launch}/", store)


def _choose_gloo_interface(master_addr: str, other_nodes: tuple[str, ...] = ()) -> None:
    """GLOO_SOCKET_IFNAME, where the profile left it unset: the interface on the route to the rendezvous host
    (jobs/netif.py: a host name resolving to 127.0.1.1 would bind every rank to loopback and hang across nodes).
    Where that route is loopback but another node of the job has an address off loopback (the rendezvous node's
    own name mapped to 127.0.1.1 in its /etc/hosts), the route towards that node. Nodes that all sit on loopback
    (one machine, as the dev cluster's) keep ``lo``."""
    if os.environ.get("GLOO_SOCKET_IFNAME"):
        return
    name = netif.gloo_interface(master_addr)
    if name == "lo" and other_nodes:
        passed = slurmenv.node_addrs(envvars.get("FSDPJOB_NODE_ADDRS"))
        addrs = (passed[node] if node in passed else reachable_address(node) for node in other_nodes)
        if (towards := next((a for a in addrs if a and not is_loopback(a)), None)) is not None:
            name, master_addr = netif.gloo_interface(towards), towards
    if name is not None:
        os.environ["GLOO_SOCKET_IFNAME"] = name
        log.info("GLOO_SOCKET_IFNAME unset: gloo uses %s, the interface towards %s", name, master_addr)


def control_group(env: DistEnv) -> dist.ProcessGroup | None:
    """The group for the loop's small host-side agreements (token counts, stop and save flags) on CPU
    tensors: over gloo they never wait for the GPU stream, so agreeing costs no device sync. None means the
    default group, which has gloo for CPU tensors already (CPU runs, CPU offload). Every rank must call this."""
    if "gloo" in env.backend:
        return None
    return dist.new_group(backend="gloo")


def export_group(timeout_s: int) -> dist.ProcessGroup:
    """A gloo group whose collectives wait ``timeout_s``: the ranks' wait for rank 0's export
    (heartbeat.export_wait_s), or for a replaced generation server (grpo/vllmgen.py). The default group's gloo half
    (CPU runs, CPU offload) and the control group are bounded by fsdp.collective_timeout_s, which a large export or
    a vLLM start can outlast. Every rank must call this."""
    return dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))


def host_barrier(control: dist.ProcessGroup | None) -> None:
    """Every rank waits here over gloo: a CPU all-reduce on ``control`` (None: the default group, which has gloo
    for CPU tensors). A barrier on NCCL would be bounded by the NCCL watchdog's collective timeout instead."""
    dist.all_reduce(torch.zeros(1), group=control)


def share_from_rank0(value: int, control: dist.ProcessGroup | None) -> int:
    """Rank 0's ``value`` on every rank, broadcast on the host-side group (``control``, as host_barrier)."""
    flag = torch.tensor([value], dtype=torch.int32)
    dist.broadcast(flag, src=0, group=control)
    return int(flag.item())


def close_distributed(*, abort: bool = False) -> None:
    """Destroy the default process group if there is one; safe to call twice. ``abort`` (a crashing rank): abort
    NCCL's communicators instead, since a destroy can block on peers still inside a collective and delay the
    exit that srun's --kill-on-bad-exit needs to end the step."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    if abort and "nccl" in str(dist.get_backend()):
        from torch.distributed.distributed_c10d import _abort_process_group  # experimental; NCCL only

        try:
            _abort_process_group()
            return
        except Exception:  # an abort that fails falls back to the ordinary destroy
            log.exception("aborting the NCCL process group failed; destroying it instead")
    dist.destroy_process_group()

