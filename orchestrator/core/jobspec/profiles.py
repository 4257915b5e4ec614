"""Cluster profiles: what a cluster offers (scheduler, partitions, GPUs, memory, setup) as strict YAML."""

from __future__ import annotations

import os
import re
import shlex
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, ValidationError, field_validator

from .. import envvars
from ..errors import ProfileError
from ..slurmtime import parse_slurm_time
from .container import ContainerSpec, Runtime
from .notifyspec import NotifySpec
from .validation import MAX_ARG_BYTES, Strict, check_env, errors_from_validation, python_path, single_line
from .yamlio import read_yaml

NonNegativeInt = Annotated[int, Field(strict=True, ge=0)]
PositiveInt = Annotated[int, Field(strict=True, gt=0)]
_SHELL_KEYWORDS = frozenset(
    "! [[ ]] { } case coproc do done elif else esac fi for function if in select then time until while".split()
)


@dataclass(frozen=True)
class SchedulerKind:
    """What a scheduler kind allows, as data: the planner and the resolver read these facts instead of branching
    on the scheduler's name (the backends in orchestrator/slurm and orchestrator/local hold the behaviour, and
    orchestrator/backend.py maps a kind to its backend)."""

    max_nodes: int | None  # None: as many as the cluster has
    where: str  # where its jobs run, as an error names it
    partitions: bool  # its jobs ask a partition for nodes, whose size the scheduler can tell (a limit names it)
    containers: bool  # it can start each task in a container (pyxis, apptainer, OCI)
    this_machine: bool  # it runs the workers on the machine fsdpjob runs on (whose cores the profile has)
    srun_in_batch: bool  # its batch side runs srun and scontrol after the job's env is exported (env.PATH keeps them)
    side_step_takes_nodes: bool  # a side step (the GRPO generation server) takes nodes of its own from the job's


KINDS = {
    "slurm": SchedulerKind(max_nodes=None, where="the cluster's nodes", partitions=True, containers=True,
                           this_machine=False, srun_in_batch=True, side_step_takes_nodes=True),
    "local": SchedulerKind(max_nodes=1, where="this machine", partitions=False, containers=False, this_machine=True,
                           srun_in_batch=False, side_step_takes_nodes=False),
}


class ClusterProfile(Strict):
    name: str
    """Profile name (the file name without .yaml)."""
    description: str = ""
    """One line shown by `fsdpjob profiles`."""
    scheduler: Literal["slurm", "local"]
    """slurm: submit with sbatch through submitit; local: start the workers on this machine."""
    partition: str | None = None
    """Default partition."""
    account: str | None = None
    """Default account."""
    qos: str | None = None
    """Default QOS."""
    constraint: str | None = None
    """Default node feature constraint."""
    preemptible_partition: str | None = None
    """A partition whose jobs may be preempted (cheaper or larger quota); informational for planning."""
    preemptible_qos: str | None = None
    """A QOS whose jobs may be preempted."""
    gpus_per_node: NonNegativeInt = 0
    """GPUs per node (0: CPU nodes)."""
    gpu_type: str | None = None
    """GPU model, e.g. A100-80GB; informational."""
    gpu_memory_gb: Annotated[float, Field(strict=True, ge=0)] = 0.0
    """Memory per GPU in GiB, the card's nominal size (80 for an A100/H100-80GB, 141 for an H200)."""
    gpu_usable_memory_gb: Annotated[float, Field(strict=True, gt=0)] | None = None
    """Memory per GPU that torch can allocate, in GiB: what the planner plans against
    (`torch.cuda.get_device_properties(0).total_memory / 2**30` on a node). Default: ~79.1 for 80 GB A100/H100,
    ~139.5 for an H200 (matched on gpu_type), else gpu_memory_gb less 1.1 %."""
    host_ram_gb: Annotated[float, Field(strict=True, gt=0)] = 64.0
    """Host RAM per node in GB (planning)."""
    cpus_per_node: PositiveInt | None = None
    """CPU cores per node; cpus_per_task defaults to cpus_per_node / tasks_per_node. A local profile: this
    machine's cores unless set."""
    max_time: str | None = None
    """Longest time limit the partition allows (Slurm time format)."""
    partition_nodes: PositiveInt | None = None
    """Nodes in the partition (`sinfo -p PARTITION -h -o %D`): validate refuses a job that asks for more. Where
    sinfo answers (a login node), validate, plan and submit also ask it how many nodes the partition has."""
    storage_bandwidth_gbps: Annotated[float, Field(strict=True, gt=0)] = 1.0
    """Checkpoint storage write bandwidth in GB/s per node (planning: save time)."""
    fabric_bandwidth_gbps: Annotated[float, Field(strict=True, gt=0)] | None = None
    """Inter-node bandwidth per node in GB/s (bytes, like storage_bandwidth_gbps; 8 x 200 Gb/s InfiniBand NICs are
    ~200 GB/s; measure with nccl-tests' all_gather_perf busbw across 2 nodes). With it, the planner adds the
    FSDP collectives' time over the fabric to a multi-node GPU step (overlapped with compute); without it,
    communication is assumed hidden, and the plan says so."""
    setup: list[str] = []
    """Shell lines run before the workers start (module load, venv or container activation). Each line is one
    command: words and $VAR / ${VAR} are kept, everything else ($(...), backticks, ;, &&, |, >) is literal."""
    env: dict[str, str] = {}
    """Environment variables set for every job on this cluster."""
    sbatch_extra: list[str] = []
    """Extra #SBATCH options, e.g. --exclusive or --gres-flags=enforce-binding."""
    srun_extra: list[str] = []
    """Extra srun options, e.g. --cpu-bind=cores."""
    python: str | None = None
    """Python interpreter on the compute nodes. Default: the interpreter running fsdpjob."""
    default_signal_lead_s: PositiveInt = 120
    """Signal lead used when the spec says signal_lead_s: auto."""
    container_runtimes: list[Runtime] = []
    """Container runtimes this cluster's Slurm can launch per task (pyxis, apptainer, oci); a spec or profile
    container of another runtime is refused at validate time."""
    container: ContainerSpec | None = None
    """Run every job's workers in this container (a spec's own container section overrides fields of it)."""
    notify: NotifySpec | None = None
    """Default notifications for every job on this cluster (a spec's notify section overrides fields of it)."""
    expected_interruptions_per_day: Annotated[float, Field(strict=True, gt=0)] | None = None
    """Interruptions per node and day that come without a warning (node failures, crashes, hangs); a job on N
    nodes sees N times as many. With it, `fsdpjob plan` prints the Young/Daly checkpoint interval and what the
    spec's interval costs. Preemptions and time limits whose signal arrives do not count: they save first."""

    @property
    def max_nodes(self) -> int | None:
        """The most nodes a job on this profile can use (None: no limit known here)."""
        limits = [n for n in (self.kind.max_nodes, self.partition_nodes) if n is not None]
        return min(limits, default=None)

    @property
    def kind(self) -> SchedulerKind:
        return KINDS[self.scheduler]

    @property
    def where(self) -> str:
        return self.kind.where

    @field_validator("max_time")
    @classmethod
    def _time(cls, value: str | None) -> str | None:
        if value is not None:
            parse_slurm_time(value)
        return value

    @field_validator("partition", "account", "qos", "constraint", "python")
    @classmethod
    def _no_control_chars(cls, value: str | None) -> str | None:
        return single_line(value)

    @field_validator("setup", "sbatch_extra", "srun_extra")
    @classmethod
    def _one_line_each(cls, value: list[str]) -> list[str]:
        for item in value:
            if re.search(r"[\x00-\x1f\x7f]", item):
                raise ValueError("each entry is one line: no newlines, tabs or other control characters")
        return value

    @field_validator("setup")
    @classmethod
    def _simple_commands(cls, value: list[str]) -> list[str]:
        for i, line in enumerate(value):
            try:
                words = shlex.split(line)
            except ValueError as exc:
                raise ValueError(f"setup line {i + 1} ({line!r}): {exc}; balance its quotes") from None
            # Keywords and comments would make a line more (or less) than the one simple command it must be.
            if words and (words[0] in _SHELL_KEYWORDS or words[0].startswith("#")):
                raise ValueError(
                    f"setup line {i + 1} ({line!r}) starts with {words[0]!r}; each line must be one simple command "
                    "(put loops, conditions or comments in a script and source it)"
                )
            # No shell reads the line: '&&' or '>' would be quoted into an argument and fail on the node.
            if operator := shell_operator(line):
                raise ValueError(
                    f"setup line {i + 1} ({line!r}) has {operator!r}; each line is one simple command and nothing "
                    "else is run by a shell: put each command on its own line (they run in order and stop at the "
                    "first failure), or put them in a script and `source` it"
                )
        return value

    @field_validator("env")
    @classmethod
    def _env(cls, value: dict[str, str]) -> dict[str, str]:
        return check_env(value)

    @field_validator("sbatch_extra", "srun_extra")
    @classmethod
    def _options(cls, value: list[str]) -> list[str]:
        for item in value:
            if not re.fullmatch(r"--?[A-Za-z][A-Za-z0-9-]*(=\S.*)?", item):
                raise ValueError(f"{item!r} is not an option; write it as --name or --name=value")
            if len(item.encode()) >= MAX_ARG_BYTES:
                raise ValueError("an option over Linux's 128 KiB argument limit: srun could not start; shorten it")
        return value

    _python = field_validator("python")(python_path)

    @property
    def max_time_s(self) -> int | None:
        return parse_slurm_time(self.max_time) if self.max_time else None


def _builtin_dir() -> Path:
    return Path(str(resources.files("fsdpjob.cluster_profiles")))


def profile_dirs() -> list[Path]:
    """User folders from $FSDPJOB_PROFILES (':'-separated) first, then the shipped profiles."""
    dirs = [Path(p).expanduser() for p in (envvars.get("FSDPJOB_PROFILES") or "").split(os.pathsep) if p]
    return dirs + [_builtin_dir()]


def available_profiles() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for d in profile_dirs():
        if d.is_dir():
            for f in sorted(d.glob("*.yaml"), key=lambda p: p.stem):
                found.setdefault(f.stem, f)
    return found


def load_profile_file(path: Path) -> ClusterProfile:
    doc = read_yaml(path, "a cluster profile")
    data = dict(doc.data)
    data.setdefault("name", path.stem)
    kind = KINDS.get(data.get("scheduler"))  # type: ignore[arg-type]
    if kind is not None and kind.this_machine:
        # A local profile is this machine: its cores, unless the file says otherwise (a shared login node).
        data.setdefault("cpus_per_node", os.cpu_count() or 1)
    try:
        return ClusterProfile.model_validate(data)
    except ValidationError as exc:
        errors = errors_from_validation(exc, doc, ClusterProfile, data=data)
        first = errors[0]
        raise ProfileError(first.message, file=first.file, line=first.line, loc=first.loc) from None


def load_profile(name_or_path: str) -> ClusterProfile:
    """A profile by name (user folders, then shipped) or by path to a YAML file."""
    looks_like_path = os.sep in name_or_path or name_or_path.endswith((".yaml", ".yml"))
    if looks_like_path:
        path = Path(name_or_path).expanduser()
        try:
            found = path.is_file()
        except OSError as exc:  # e.g. a name too long for the file system
            raise ProfileError(f"profile file {name_or_path!r} cannot be read: {exc.strerror}") from None
        if not found:
            raise ProfileError(_folder(name_or_path) or f"profile file {name_or_path!r} not found")
        return load_profile_file(path)
    profiles = available_profiles()
    if name_or_path not in profiles and (folder := _folder(name_or_path)):
        raise ProfileError(folder)
    if name_or_path not in profiles:
        import difflib

        close = difflib.get_close_matches(name_or_path, list(profiles), n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ProfileError(
            f"unknown profile {name_or_path!r}; {hint}valid profiles are: {', '.join(sorted(profiles))} "
            "(or give a path to a profile YAML; add folders with $FSDPJOB_PROFILES)"
        )
    return load_profile_file(profiles[name_or_path])


def _folder(name_or_path: str) -> str | None:
    """What to say when the profile named is a folder (a folder of profiles, most likely)."""
    try:
        if not Path(name_or_path).expanduser().is_dir():
            return None
    except OSError:
        return None
    return (f"{name_or_path!r} is a folder, not a profile; give a profile YAML file (e.g. {name_or_path.rstrip('/')}/"
            "NAME.yaml) or a profile name (a folder of profiles goes in $FSDPJOB_PROFILES)")


def shell_operator(line: str) -> str | None:
    """The first unquoted shell operator (;, &&, ||, |, &, <, >, parentheses) or substitution ($(, `) in
    ``line``, or None."""
    for mark in ("$(", "`"):
        if mark in line:
            return mark
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    return next((token for token in lexer if token and set(token) <= set("();<>|&")), None)
