"""The on-disk layout of a checkpoint root, shared by the worker (jobs/checkpoint/manager.py writes it) and the
login node (status reads it): plain file reads, no torch. The sidecar's contents are core/runfolder/sidecar.py's.

    <root>/step-00000120/      DCP shards (__<rank>_0.distcp), .metadata, fsdpjob.json, COMMITTED
    <root>/latest              name of the newest committed step folder (informational)

A step counts only once ``COMMITTED`` exists; it is written last (see jobs/checkpoint/manager.py).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from .runmeta import checkpoint_root  # the rule lives with spec.json, under this one name

MARKER = "COMMITTED"
SIDECAR = "fsdpjob.json"
METADATA = ".metadata"  # DCP's
LATEST = "latest"
_STEP_RE = re.compile(r"step-(\d+)")


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def parse_step(name: str) -> int | None:
    """Step number of a folder named step-N (zero-padded or not); None for anything else."""
    match = _STEP_RE.fullmatch(name)
    return int(match.group(1)) if match else None


def step_dirs(root: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every step-N folder under root, committed or not, oldest first."""
    if not root.is_dir():
        return []
    found = [(parse_step(p.name), p) for p in root.iterdir() if p.is_dir()]
    return sorted((s, p) for s, p in found if s is not None)


def committed_steps(root: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every committed step under root, oldest first."""
    return [(s, p) for s, p in step_dirs(root) if (p / MARKER).is_file()]


def uncommitted_steps(root: Path) -> list[tuple[int, Path]]:
    return [(s, p) for s, p in step_dirs(root) if not (p / MARKER).is_file()]


def resume_problem(path: Path) -> str | None:
    """Why ``path`` (`submit --resume-from`) holds no committed checkpoint the workers could start from, or None:
    found on the login node, before the queue wait, by the rules the worker's select_checkpoint applies."""
    if not path.is_dir():
        return f"{path} is not a folder"
    if parse_step(path.name) is not None or (path / ".metadata").exists() or (path / MARKER).exists():
        if not (path / MARKER).is_file():
            return f"{path} is a checkpoint that was never committed (its save did not finish); pick a committed step-N"
        return None
    root = path if step_dirs(path) else checkpoint_root(path)
    if not committed_steps(root):
        return (f"{path} is not a checkpoint: no committed step-N folder in it or in its run's checkpoints folder; "
                "give a step-N folder, a checkpoints folder or a run folder that holds one")
    return None


PSEUDO_FILE_SYSTEMS = ("/proc", "/sys", "/dev")


def pseudo_file_system(path: Path) -> str | None:
    """The pseudo file system ``path`` is under (/proc, /sys, /dev), or None. os.access says yes to root there, and
    writes then fail on the workers (/dev/shm, a real tmpfs, is the exception)."""
    text = os.path.normpath(str(path))
    if text == "/dev/shm" or text.startswith("/dev/shm/"):
        return None
    return next((root for root in PSEUDO_FILE_SYSTEMS if text == root or text.startswith(root + "/")), None)


def unwritable(folder: Path) -> str | None:
    """Why the workers could not create and write checkpoints in ``folder`` (checked from here, the same file
    system on a cluster), or None: the folder, or the nearest existing folder above it, must be writable."""
    if pseudo := pseudo_file_system(folder):
        return f"{folder} is under {pseudo}, a kernel pseudo file system where no files can be kept"
    existing = folder
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        return f"{existing} is a file, so {folder} cannot be created"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"{existing} is not writable by you, so checkpoints cannot be written in {folder}"
    return None
