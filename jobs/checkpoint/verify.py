"""Which checkpoint a run may resume from: step folder verification, the fingerprint check, selection.

Plain filesystem functions, usable without a process group (export); CheckpointManager runs them
on rank 0 and shares the answer.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint import FileSystemReader

from fsdpjob.orchestrator.core.runfolder.ckptlayout import (
    MARKER,
    SIDECAR,
    committed_steps,
    parse_step,
    step_dirs,
)
from fsdpjob.orchestrator.core.runfolder.runmeta import checkpoint_root
from fsdpjob.orchestrator.core.runfolder.sidecar import Sidecar

from .checksum import content_damage, recorded_sums, size_damage

log = logging.getLogger("fsdpjob.checkpoint")

_FRESH_HINT = "to start fresh instead, use a new run name or --set checkpoint.dir=<empty folder>"


class CheckpointError(Exception):
    """A checkpoint path the user gave (or the run's checkpoint folder) cannot be used."""


class ResumeRefused(CheckpointError):
    """The newest checkpoint was written by a run whose model-defining fields differ from this spec."""


def damage(step_dir: Path) -> str | None:
    """Why a step folder cannot be resumed from, or None when it verifies.

    Checks the marker, the sidecar, the DCP ``.metadata``, and that every shard file the metadata
    points into exists and is at least as long as its last item ends.
    """
    if not (step_dir / MARKER).is_file():
        return f"no {MARKER} marker (the save did not finish)"
    try:
        Sidecar.read(step_dir)
    except (OSError, ValueError) as exc:
        return f"sidecar {SIDECAR} is unreadable ({exc})"
    try:
        metadata = FileSystemReader(str(step_dir)).read_metadata()
    except Exception as exc:  # any failure to read the metadata means the step is damaged
        return f".metadata is unreadable ({type(exc).__name__}: {exc})"
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        shard = step_dir / name
        if not shard.is_file():
            return f"shard {name} is missing"
        actual = shard.stat().st_size
        if actual < size:
            return f"shard {name} is truncated ({actual} bytes, expected at least {size})"
    sums = recorded_sums(step_dir)
    return size_damage(step_dir, sums) if sums is not None else None


def all_damage(step_dir: Path) -> str | None:
    """damage(), and whether every summed file still has the bytes that were written (reads the whole step)."""
    reason = damage(step_dir)
    if reason is None and (sums := recorded_sums(step_dir)) is not None:
        reason = content_damage(step_dir, sums, sorted(sums))
    return reason


def fingerprint_differences(saved: dict[str, Any], wanted: dict[str, Any]) -> list[str]:
    keys = sorted(set(saved) | set(wanted))
    return [
        f"{k}: checkpoint has {saved.get(k, '<absent>')!r}, this spec has {wanted.get(k, '<absent>')!r}"
        for k in keys
        if saved.get(k) != wanted.get(k)
    ]


def check_fingerprint(step_dir: Path, fingerprint: dict[str, Any] | None) -> None:
    if fingerprint is None:
        return
    saved = Sidecar.read(step_dir).run.fingerprint or {}
    diffs = fingerprint_differences(saved, fingerprint)
    if diffs:
        raise ResumeRefused(
            f"refusing to resume from {step_dir}: model-defining fields changed ({'; '.join(diffs)}); {_FRESH_HINT}"
        )


def newest_valid_steps(root: Path, fingerprint: dict[str, Any] | None = None,
                       corrupt: dict[Path, str] | None = None) -> tuple[Path | None, list[str]]:
    """Newest committed step under root that passes damage() and is not in ``corrupt`` (step folder -> why its bytes
    are known bad), and why each newer one was passed over; damaged ones are skipped with a warning.

    None when nothing was ever committed. When every committed step is damaged this raises rather
    than silently starting over.
    """
    corrupt = corrupt or {}
    damaged = []
    for _, step_dir in reversed(committed_steps(root)):
        reason = corrupt.get(step_dir)
        if reason is None and (reason := damage(step_dir)) is not None:
            log.warning("checkpoint %s is damaged: %s; falling back to the previous committed step", step_dir, reason)
        if reason is None:
            check_fingerprint(step_dir, fingerprint)
            return step_dir, damaged
        damaged.append(f"{step_dir.name}: {reason}")
    if damaged:
        raise CheckpointError(f"{root}: every committed checkpoint is damaged ({'; '.join(damaged)}); {_FRESH_HINT}")
    return None, []


def newest_valid_step(root: Path, fingerprint: dict[str, Any] | None = None) -> Path | None:
    """Newest committed step under root whose files, their bytes included, verify (one process reads them all: export
    and an explicit --resume-from; the manager's resume shares the reading among the ranks)."""
    corrupt: dict[Path, str] = {}
    while (found := newest_valid_steps(root, fingerprint, corrupt)[0]) is not None:
        sums = recorded_sums(found)
        reason = content_damage(found, sums, sorted(sums)) if sums is not None else None
        if reason is None:
            return found
        log.warning("checkpoint %s is corrupted: %s; falling back to the previous committed step", found, reason)
        corrupt[found] = reason
    return None


def select_checkpoint(path: Path, fingerprint: dict[str, Any] | None = None) -> Path:
    """A verified step folder from a step folder, a checkpoint root, or a run folder with checkpoints/."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such checkpoint folder")
    is_step = parse_step(path.name) is not None or (path / ".metadata").exists() or (path / MARKER).exists()
    if is_step:
        reason = all_damage(path)
        if reason is not None:
            raise CheckpointError(f"{path}: cannot resume from this checkpoint: {reason}")
        check_fingerprint(path, fingerprint)
        return path
    root = path if step_dirs(path) else checkpoint_root(path)
    if not root.is_dir():
        raise CheckpointError(f"{path}: not a checkpoint (no step-N folders and no checkpoints/ folder inside)")
    found = newest_valid_step(root, fingerprint)
    if found is None:
        raise CheckpointError(f"{root}: no committed checkpoint that verifies")
    return found
