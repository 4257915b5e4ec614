"""A checkpoint step folder's ``fsdpjob.json``, typed: the one writer (the checkpoint manager's commit) and the one
reader (resume, verification, keep_best, export) of the file. Standard library only, like the rest of the core.

The JSON layout is the one checkpoints have always had, so older step folders stay readable: one flat object with
the run's facts, the manager's facts, the save's facts, and each flat state entry (train counters, data position)
under its own top-level key.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from ..fileio import write_atomic
from .ckptlayout import SIDECAR

FORMAT_VERSION = 1

# Fingerprint keys export reads: the spec's model.lora (core/jobspec/spec.py model_fingerprint) and, with LoRA, the base
# model folder's content hash (jobs/model/lora.py checkpoint_fingerprint).
LORA_FINGERPRINT = "model.lora"
BASE_CONTENTS_FINGERPRINT = "model.path contents"
QUANTIZE_FINGERPRINT, DTYPE_FINGERPRINT = "model.quantize", "model.dtype"  # a QLoRA base: its 4-bit form, its dtype


@dataclass(frozen=True)
class RunFacts:
    """What a run passes to its checkpoint manager once: the same in every step folder it writes. Unset fields are
    not written (benches and tests run a manager without a spec)."""

    spec_hash: str | None = None
    fingerprint: dict[str, Any] | None = None  # what a resume must match (checkpoint/verify.py)
    mesh_shape: tuple[int, ...] | None = None
    model_path: str | None = None

    @classmethod
    def of(cls, facts: Mapping[str, Any]) -> RunFacts:
        """From a dict of run facts (the manager's dict-era callers); a key that is no run fact is an error, not a
        silently dropped fact. world_size and fsdpjob_version are allowed: the manager writes those itself."""
        unknown = set(facts) - _RUN_KEYS - {"world_size", "fsdpjob_version"}
        if unknown:
            raise TypeError(f"not checkpoint run facts: {sorted(unknown)} (known: {sorted(_RUN_KEYS)})")
        return cls.from_json(facts)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> RunFacts:
        """Its fields out of a whole sidecar object; other keys are left to the caller."""
        mesh = _typed(data, "mesh_shape", (list, tuple))
        return cls(
            spec_hash=_typed(data, "spec_hash", str),
            fingerprint=_typed(data, "fingerprint", dict),
            mesh_shape=tuple(mesh) if mesh is not None else None,
            model_path=_typed(data, "model_path", str),
        )

    def to_json(self) -> dict[str, Any]:
        doc = {"spec_hash": self.spec_hash, "fingerprint": self.fingerprint, "model_path": self.model_path,
               "mesh_shape": list(self.mesh_shape) if self.mesh_shape is not None else None}
        return {k: v for k, v in doc.items() if v is not None}

    @property
    def lora(self) -> dict[str, Any] | None:
        """The spec's model.lora the checkpoint was trained with; None for a checkpoint of every weight."""
        return (self.fingerprint or {}).get(LORA_FINGERPRINT)

    @property
    def quantize(self) -> tuple[str, str] | None:
        """A QLoRA checkpoint's base quantization and the dtype it was quantized from; None otherwise."""
        facts = self.fingerprint or {}
        kind = facts.get(QUANTIZE_FINGERPRINT)
        return (kind, facts.get(DTYPE_FINGERPRINT, "float32")) if kind else None

    @property
    def base_contents(self) -> str | None:
        """A LoRA checkpoint's base model content hash (jobs/model/lora.py base_fingerprint), if recorded."""
        return (self.fingerprint or {}).get(BASE_CONTENTS_FINGERPRINT)


@dataclass(frozen=True)
class Sidecar:
    """One committed step's facts. ``state`` holds the flat scalar state entries by their state key, so a resume
    can read them before the objects that load them exist; the dicts are the file's, not to be changed."""

    step: int | None = None  # None only in a file no manager wrote (tests' fixtures); load() refuses it
    world_size: int | None = None  # of the run that wrote it: a resume on another world size re-derives its RNG
    run: RunFacts = field(default_factory=RunFacts)
    # The manager's facts.
    format: int | None = FORMAT_VERSION
    fsdpjob_version: str | None = None
    torch_version: str | None = None
    wall_time: float | None = None
    save_seconds: float | None = None
    # The save's facts: why it was taken, where export finds the weights ("<model_key>.model.<hf name>"), and the
    # evaluation of these weights (keep_best).
    reason: str | None = None
    model_key: str | None = None
    eval_loss: float | None = None
    state: dict[str, dict[str, Any]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        taken = sorted(set(self.state) & FIELD_KEYS)
        if taken:
            raise ValueError(f"state entries {taken} would overwrite sidecar fields of the same name")

    # -- the file ----------------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        # Keys as the manager always wrote them: every manager and save fact (model_key null when no entry holds
        # the weights), eval_loss only when there is one, run facts only when set.
        doc: dict[str, Any] = {
            **self.run.to_json(),
            "format": self.format, "fsdpjob_version": self.fsdpjob_version, "torch_version": self.torch_version,
            "world_size": self.world_size, "step": self.step, "wall_time": self.wall_time,
            "save_seconds": self.save_seconds, "reason": self.reason, "model_key": self.model_key,
            **self.state,
        }
        if self.eval_loss is not None:
            doc["eval_loss"] = self.eval_loss
        return doc

    def write(self, step_dir: Path) -> None:
        write_atomic(Path(step_dir) / SIDECAR, json.dumps(self.to_json(), indent=2, sort_keys=True) + "\n")

    @classmethod
    def from_json(cls, data: Any) -> Sidecar:
        """Raises ValueError for anything but a JSON object whose known keys hold their types; any may be missing,
        as readers before this type never required one (export and keep_best read single keys)."""
        if not isinstance(data, dict):
            raise ValueError(f"a sidecar is a JSON object, not {type(data).__name__}")
        return cls(
            step=_typed(data, "step", int),
            world_size=_typed(data, "world_size", int),
            run=RunFacts.from_json(data),
            format=_typed(data, "format", int),
            fsdpjob_version=_typed(data, "fsdpjob_version", str),
            torch_version=_typed(data, "torch_version", str),
            wall_time=_float(_typed(data, "wall_time", (int, float))),
            save_seconds=_float(_typed(data, "save_seconds", (int, float))),
            reason=_typed(data, "reason", str),
            model_key=_typed(data, "model_key", str),
            eval_loss=_float(_typed(data, "eval_loss", (int, float))),
            # Other object-valued keys are state entries; other scalars (a fact a later version added) are skipped.
            state={k: v for k, v in data.items() if k not in FIELD_KEYS and isinstance(v, dict)},
        )

    @classmethod
    def read(cls, step_dir: Path) -> Sidecar:
        """Raises OSError (no such file) or ValueError (not JSON, or not a sidecar)."""
        return cls.from_json(json.loads((Path(step_dir) / SIDECAR).read_text(encoding="utf-8")))

    def __getitem__(self, key: str) -> Any:
        """Dict-style access for callers from before this type (bench/crash_consistency.py reads load()["step"]);
        new code uses the fields."""
        return self.to_json()[key]


def best_step(committed: list[tuple[int, Path]],
              on_unreadable: Callable[[Path, Exception], None] | None = None) -> Path | None:
    """The committed step folder whose sidecar records the lowest eval loss (the older one on a tie), if any does:
    the one checkpoint.keep_best keeps. The worker's purge and `fsdpjob prune` both ask this, so that they agree.
    A damaged sidecar is no candidate (``on_unreadable`` hears of it)."""
    best: tuple[float, int, Path] | None = None
    for step, step_dir in committed:
        try:
            loss = Sidecar.read(step_dir).eval_loss
        except (OSError, ValueError, TypeError) as exc:
            if on_unreadable is not None:
                on_unreadable(step_dir, exc)
            continue
        if loss is not None and math.isfinite(loss) and (best is None or loss < best[0]):
            best = (loss, step, step_dir)
    return best[2] if best else None


def _typed(data: Mapping[str, Any], key: str, types: type | tuple[type, ...]) -> Any:
    """data[key] when it is of ``types`` (bool is no number here), None when absent or null; ValueError otherwise."""
    value = data.get(key)
    if value is not None and (isinstance(value, bool) or not isinstance(value, types)):
        names = " or ".join(t.__name__ for t in (types if isinstance(types, tuple) else (types,)))
        raise ValueError(f"sidecar {key!r} is {value!r}, not {names}")
    return value


def _float(value: int | float | None) -> float | None:
    return float(value) if value is not None else None


_RUN_KEYS = frozenset(f.name for f in fields(RunFacts))
# Every top-level key that is no state entry: a state entry of such a name is not written (checkpoint/manager.py).
FIELD_KEYS = _RUN_KEYS | {f.name for f in fields(Sidecar) if f.name not in ("run", "state")}
