"""Spec + profile -> the effective job (resources, signal lead, world size), with the cross checks that need both."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fsdpjob.orchestrator.core.errors import SpecError
from fsdpjob.orchestrator.core.jobspec.profiles import ClusterProfile
from fsdpjob.orchestrator.core.jobspec.spec import JobSpec
from fsdpjob.orchestrator.core.jobspec.validation import SpecErrors
from fsdpjob.orchestrator.core.jobspec.yamlio import YamlDoc
from fsdpjob.orchestrator.core.runfolder.paths import runs_root
from fsdpjob.orchestrator.core.slurmtime import format_slurm_time

from .containers import ContainerPlan, container_plan, container_problems
from .generator import generator_problems


@dataclass(frozen=True)
class Effective:
    """What the job will actually ask for, after profile defaults are applied. Pure data."""

    scheduler: str
    nodes: int
    gpus_per_node: int
    tasks_per_node: int
    cpus_per_task: int | None
    mem_per_node: str | None
    time_limit_s: int
    partition: str | None
    account: str | None
    qos: str | None
    constraint: str | None
    signal: str
    signal_lead_s: int

    @property
    def world_size(self) -> int:
        return self.nodes * self.tasks_per_node

    @property
    def time_limit(self) -> str:
        return format_slurm_time(self.time_limit_s)


def apply_profile(spec: JobSpec, profile: ClusterProfile) -> Effective:
    """Apply profile defaults. Does not validate; see :func:`check`."""
    r = spec.resources
    gpus = r.gpus_per_node if r.gpus_per_node is not None else profile.gpus_per_node
    tasks = r.tasks_per_node or (gpus if gpus > 0 else 1)
    cpus = r.cpus_per_task
    if cpus is None and profile.cpus_per_node:
        cpus = max(1, profile.cpus_per_node // tasks)
    lead = spec.preemption.signal_lead_s
    if lead == "auto":
        # A tenth of a short time limit, so that a 10-minute debug job still gets its signal.
        lead = min(profile.default_signal_lead_s, max(10, r.time_limit_s // 10))
    return Effective(
        scheduler=profile.scheduler,
        nodes=r.nodes,
        gpus_per_node=gpus,
        tasks_per_node=tasks,
        cpus_per_task=cpus,
        mem_per_node=r.mem_per_node,
        time_limit_s=r.time_limit_s,
        partition=r.partition or profile.partition,
        account=r.account or profile.account,
        qos=r.qos or profile.qos,
        constraint=r.constraint or profile.constraint,
        signal=spec.preemption.signal,
        signal_lead_s=int(lead),
    )


PartitionSize = tuple[str, int]  # (partition, its node count) as Slurm said it (slurm/commands.py partition_size)


def problems(spec: JobSpec, profile: ClusterProfile,
             partition_size: PartitionSize | None = None) -> list[tuple[tuple, str]]:
    """Cross checks between spec and profile (and ``partition_size``, the job's partition as sinfo counted it,
    when the caller could ask), as (loc, message) pairs. Messages show the arithmetic."""
    eff = apply_profile(spec, profile)
    out: list[tuple[tuple, str]] = []
    if spec.resources.gpus_per_node and profile.gpus_per_node and spec.resources.gpus_per_node > profile.gpus_per_node:
        out.append(
            (
                ("resources", "gpus_per_node"),
                f"{spec.resources.gpus_per_node} GPUs per node requested but profile {profile.name!r} nodes have "
                f"{profile.gpus_per_node}; lower it or add nodes",
            )
        )
    if eff.gpus_per_node and eff.tasks_per_node != eff.gpus_per_node and spec.resources.gpus_per_node is None:
        # The spec model checks this when the spec sets both; here the GPU count comes from the profile.
        out.append(
            (
                ("resources", "tasks_per_node"),
                f"tasks_per_node ({eff.tasks_per_node}) must equal gpus_per_node ({eff.gpus_per_node}, from profile "
                f"{profile.name!r}): fsdpjob runs one worker per GPU; drop tasks_per_node to take the default",
            )
        )
    if eff.world_size % spec.fsdp.replicate_degree:
        out.append(
            (
                ("fsdp", "replicate_degree"),
                f"world size = nodes ({eff.nodes}) x tasks_per_node ({eff.tasks_per_node}) = {eff.world_size}, "
                f"not divisible by replicate_degree ({spec.fsdp.replicate_degree}); pick a divisor of {eff.world_size}",
            )
        )
    if profile.max_time_s and eff.time_limit_s > profile.max_time_s:
        out.append(
            (
                ("resources", "time_limit"),
                f"{spec.resources.time_limit} ({eff.time_limit} = {eff.time_limit_s} s) exceeds profile "
                f"{profile.name!r} max_time {profile.max_time} ({profile.max_time_s} s); shorten it (checkpoints "
                "and requeues carry the run across allocations)",
            )
        )
    if eff.signal_lead_s >= eff.time_limit_s:
        out.append(
            (
                ("preemption", "signal_lead_s"),
                f"signal lead {eff.signal_lead_s} s is not shorter than the time limit {eff.time_limit_s} s; "
                "lower signal_lead_s or raise resources.time_limit",
            )
        )
    if profile.kind.srun_in_batch and "PATH" in spec.env and not spec.env["PATH"].strip(":").strip():
        # The supervisor runs srun and scontrol in the batch script after the job's env is exported.
        out.append((("env", "PATH"), "an empty PATH hides srun and scontrol from the job's supervisor; drop "
                                     "env.PATH, or extend it: $PATH:/my/bin"))
    out += generator_problems(spec, profile, eff.nodes, eff.gpus_per_node, eff.tasks_per_node)
    out += _size_problems(spec, profile, eff, partition_size)
    out += container_problems(spec, profile, str(runs_root()))
    return out


def partition_size_unknown(spec: JobSpec, profile: ClusterProfile, eff: Effective) -> str | None:
    """The warning for a multi-node job whose partition's size neither the profile (partition_nodes) nor the
    scheduler (sinfo, asked by the caller, which got no answer) gave: nothing checked its nodes, and a job larger
    than the partition would pend forever. One node always fits: no warning then."""
    if not profile.kind.partitions or eff.nodes <= 1:
        return None
    if profile.partition_nodes is not None and spec.resources.partition in (None, profile.partition):
        return None  # checked against the profile's count
    where = f"partition {eff.partition}" if eff.partition else "the default partition"
    return (f"partition size unknown: {eff.nodes} nodes are not checked against {where} (profile {profile.name!r} "
            "sets no partition_nodes for it, and sinfo gave no answer here); set partition_nodes in the profile, "
            "or plan on the cluster's login node")


def _size_problems(spec: JobSpec, profile: ClusterProfile, eff: Effective,
                   partition_size: PartitionSize | None) -> list[tuple[tuple, str]]:
    """Sizes the profile's nodes cannot hold: Slurm would refuse or never start such a job, or the ranks would
    fight over cores or train on the CPUs of GPU nodes."""
    out: list[tuple[tuple, str]] = []
    r = spec.resources
    # The profile's partition_nodes counts its own partition's nodes, not those of one the spec names instead.
    limit = profile.max_nodes if r.partition in (None, profile.partition) else profile.kind.max_nodes
    if limit is not None and eff.nodes > limit:
        where = (f"partition {eff.partition} of profile {profile.name!r} has {limit} node(s) (its partition_nodes)"
                 if profile.kind.partitions else f"the {profile.scheduler} profile runs on {profile.where} only")
        out.append((("resources", "nodes"), f"{where}: nodes must be at most {limit}, got {eff.nodes}"))
    elif partition_size is not None and profile.kind.partitions and eff.nodes > partition_size[1]:
        name, count = partition_size
        out.append((("resources", "nodes"),
                    f"partition {name} has {count} node(s) (sinfo): nodes must be at most {count}, got {eff.nodes}; "
                    f"set resources.nodes to at most {count}, or name a larger partition in resources.partition"))
    if profile.gpus_per_node and r.gpus_per_node == 0:
        out.append((("resources", "gpus_per_node"),
                    f"gpus_per_node: 0 on profile {profile.name!r} (nodes with {profile.gpus_per_node} GPUs) "
                    "would train on the CPUs of GPU nodes; drop gpus_per_node (one worker per GPU), or use a CPU "
                    "profile (--profile local)"))
    cores = profile.cpus_per_node
    if cores and eff.cpus_per_task and eff.tasks_per_node * eff.cpus_per_task > cores:
        total = f"tasks_per_node ({eff.tasks_per_node}) x cpus_per_task ({eff.cpus_per_task})"
        if r.cpus_per_task is not None and eff.tasks_per_node <= cores:
            out.append((("resources", "cpus_per_task"),
                        f"{total} = {eff.tasks_per_node * eff.cpus_per_task} cores, more than the {cores} of a "
                        f"{profile.name!r} node; set cpus_per_task to at most {cores // eff.tasks_per_node}"))
        else:
            out.append((("resources", "tasks_per_node"),
                        f"{total} = {eff.tasks_per_node * eff.cpus_per_task} cores, more than the {cores} of a "
                        f"{profile.name!r} node; use at most {cores} tasks per node (one core each)"
                        + ("" if profile.max_nodes == 1 else ", or more nodes")))
    return out


@dataclass(frozen=True)
class Resolved:
    """A spec resolved against its profile, once; planning and rendering take this."""

    spec: JobSpec
    profile: ClusterProfile
    eff: Effective
    # Why the partition's size could not be checked (a plan warning), where the check was asked for and failed.
    size_unknown: str | None = field(default=None, kw_only=True)
    # The workers' container, decided once here (planner/containers.py); None: no container.
    container: ContainerPlan | None = field(default=None, kw_only=True)


def resolve(spec: JobSpec, profile: ClusterProfile, doc: YamlDoc | None = None,
            partition_size: PartitionSize | None = None) -> Resolved:
    """Check spec against profile (SpecErrors with FILE:LINE when ``doc`` is given) and apply its defaults."""
    eff = check(spec, profile, doc, partition_size)
    return Resolved(spec=spec, profile=profile, eff=eff, container=container_plan(spec, profile))


def check(spec: JobSpec, profile: ClusterProfile, doc: YamlDoc | None = None,
          partition_size: PartitionSize | None = None) -> Effective:
    """Raise SpecErrors (with FILE:LINE when ``doc`` is given) for spec/profile conflicts."""
    found = problems(spec, profile, partition_size)
    if found:
        raise SpecErrors([SpecError.at(doc, loc, msg) for loc, msg in found])
    return apply_profile(spec, profile)


def resolved_spec(job: Resolved) -> dict[str, Any]:
    """The resolved spec `fsdpjob show` prints: what the workers would run with, as a spec: every field set (the
    defaults), the profile's values filled in (resources, signal lead, container) and secrets redacted."""
    data = job.spec.redacted().model_dump(mode="json")
    eff = job.eff
    data["resources"].update(
        gpus_per_node=eff.gpus_per_node, tasks_per_node=eff.tasks_per_node, cpus_per_task=eff.cpus_per_task,
        partition=eff.partition, account=eff.account, qos=eff.qos, constraint=eff.constraint,
    )
    data["preemption"]["signal_lead_s"] = eff.signal_lead_s  # "auto" made a number
    data["container"] = job.container.container.model_dump(mode="json") if job.container else None
    return data
