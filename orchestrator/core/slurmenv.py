"""What Slurm tells a process of a job through its environment: the one place both sides read these
variables. Pure: a worker inside a container (no Slurm binaries, no munge) still has them."""

from __future__ import annotations

import os
from collections.abc import Mapping


def job_id_from_env(env: Mapping[str, str] = os.environ) -> str | None:
    """The running job's id as scontrol takes it: <array job>_<task> for an array task, else SLURM_JOB_ID."""
    array_job, array_task = env.get("SLURM_ARRAY_JOB_ID"), env.get("SLURM_ARRAY_TASK_ID")
    if array_job and array_task:
        return f"{array_job}_{array_task}"
    return env.get("SLURM_JOB_ID") or None


def restart_count(env: Mapping[str, str] = os.environ) -> int:
    """How often Slurm has restarted the running job (0 on its first run)."""
    return int(env.get("SLURM_RESTART_COUNT", "0") or 0)


def gpus_per_node(env: Mapping[str, str] = os.environ) -> str | None:
    """The job's --gpus-per-node as sbatch saw it ("8", or typed "h100:8"), set only where the job asked so (the
    batch script does on GPU profiles); None otherwise or for 0."""
    value = (env.get("SLURM_GPUS_PER_NODE") or "").strip()
    return value if value and value.rpartition(":")[2] != "0" else None


def node_addrs(text: str | None) -> dict[str, str]:
    """FSDPJOB_NODE_ADDRS ("n1=10.0.0.1,n2=10.0.0.2", the supervisor's), as {node: address}."""
    pairs = (item.split("=", 1) for item in (text or "").split(",") if "=" in item)
    return {node: addr for node, addr in pairs if node and addr}


def format_node_addrs(addrs: Mapping[str, str]) -> str:
    return ",".join(f"{node}={addr}" for node, addr in sorted(addrs.items()))
