"""The run folder's spec.json, typed: what `fsdpjob submit` hands the workers, the supervisor and the batch
script (one writer format, every reader through ``RunMeta.read``). Standard library only: jobs/entry.py reads
the stop signal here before torch and pydantic load.

The spec is kept as its JSON (the resolved, redacted JobSpec): the worker and the supervisor validate it
into a JobSpec themselves, and the batch script and the views read single fields without validating.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from ..fileio import write_atomic
from .paths import RunPaths

DEFAULT_STOP_SIGNAL = "USR2"  # spec.preemption.signal's default, for a run folder that cannot be read


@dataclass(frozen=True)
class EffectiveFacts:
    """The resolved allocation the script asks for (planner/resolve.Effective, as submit saw it)."""

    nodes: int | None = None
    tasks_per_node: int | None = None
    world_size: int | None = None
    signal: str | None = None
    signal_lead_s: int | None = None
    time_limit_s: int | None = None
    scheduler: str | None = None

    @classmethod
    def from_json(cls, data: dict[str, Any] | None) -> EffectiveFacts:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in (data or {}).items() if k in names})


@dataclass(frozen=True)
class RunFacts:
    """A run's size and submit time: what its goodput accounting needs besides its log
    (core/goodput/account.py).
    From a registry record on the login side (views/goodput.py), from spec.json on the batch side."""

    run_id: str
    nodes: int
    tasks_per_node: int
    gpus_per_node: int | None  # 0: a CPU profile; None: not known (records written before it was kept)
    submitted_at: float | None = None  # None: not known here (the batch side): the first start stands in

    @property
    def world_size(self) -> int:
        return self.nodes * self.tasks_per_node


@dataclass(frozen=True)
class RunMeta:
    """One run's spec.json. ``worker_facts`` are the planner's decisions that depend on memory
    (planner/fit.FitPlan.worker_facts, e.g. defer_grad_sync); files written before the rename call them "plan"."""

    spec: dict[str, Any]
    spec_hash: str | None = None
    spec_source: str | None = None
    profile: dict[str, Any] = field(default_factory=dict)
    effective: EffectiveFacts = field(default_factory=EffectiveFacts)
    resume_from: str | None = None
    worker_facts: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, spec: Any, **facts: Any) -> RunMeta:
        """For a JobSpec (redacted by the caller where secrets must not reach the disk)."""
        return cls(spec=spec.model_dump(mode="json"), **{"spec_hash": spec.spec_hash(), **facts})

    # -- the file ----------------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "effective": asdict(self.effective)}

    def write(self, paths: RunPaths) -> None:
        write_atomic(paths.spec_file, json.dumps(self.to_json(), indent=1, sort_keys=True))

    @classmethod
    def read(cls, run_dir: str | Path) -> RunMeta:
        """Raises OSError (no such file) or ValueError (not a spec.json)."""
        data = json.loads(RunPaths(Path(run_dir)).spec_file.read_text(encoding="utf-8"))
        if not isinstance(data, dict) or not isinstance(data.get("spec"), dict):
            raise ValueError(f"{RunPaths(Path(run_dir)).spec_file} holds no spec")
        return cls(
            spec=data["spec"],
            spec_hash=data.get("spec_hash"),
            spec_source=data.get("spec_source"),
            profile=data.get("profile") or {},
            effective=EffectiveFacts.from_json(data.get("effective")),
            resume_from=data.get("resume_from"),
            worker_facts=data.get("worker_facts", data.get("plan")) or {},  # "plan": runs queued before the rename
        )

    def run_facts(self, run_id: str) -> RunFacts:
        """The allocation submit resolved, and the profile's GPUs per node (when it was submitted: not kept here)."""
        eff = self.effective
        return RunFacts(run_id=run_id, nodes=eff.nodes or 1, tasks_per_node=eff.tasks_per_node or 1,
                        gpus_per_node=self.profile.get("gpus_per_node"))

    # -- single fields, for readers that do not validate the spec -------------------------------------
    def section(self, name: str) -> dict[str, Any]:
        value = self.spec.get(name)
        return value if isinstance(value, dict) else {}

    def checkpoint_root(self, paths: RunPaths) -> Path:
        """The run's checkpoint root: checkpoint.dir when set, else the run folder's checkpoints/. The one
        place of this rule: the worker writes there, status, the supervisor and export read there."""
        configured = self.section("checkpoint").get("dir")
        return Path(configured) if configured else paths.checkpoints_dir


def checkpoint_root(run_dir: str | Path) -> Path:
    """``RunMeta.checkpoint_root`` of a run folder whose spec.json may be missing or unreadable (then the default)."""
    paths = RunPaths(Path(run_dir))
    try:
        return RunMeta.read(run_dir).checkpoint_root(paths)
    except (OSError, ValueError, TypeError, AttributeError):
        return paths.checkpoints_dir


def stop_signal(run_dir: str | Path) -> str:
    """The spec's preemption.signal, cheaply (no pydantic; the worker validates the spec later)."""
    try:
        return RunMeta.read(run_dir).section("preemption")["signal"]
    except (OSError, ValueError, KeyError, TypeError):
        return DEFAULT_STOP_SIGNAL
