"""A durable save that the checkpoint folder's file system has no room for: told as such (ENOSPC, the folder, the
free bytes, what a step needs), its half-written step removed (never taken for a checkpoint: it has no COMMITTED,
and its files would only keep the disk full), and the run stopped cleanly: a restart would fill the disk again at
its next save, so the error is not retryable, and the newest committed step stays what a resume takes."""

from __future__ import annotations

import errno
import os
import re
import shutil
from pathlib import Path

from torch.distributed.checkpoint.api import CheckpointException

from fsdpjob.orchestrator.core.runfolder.ckptlayout import MARKER, committed_steps

from .verify import CheckpointError


class DiskFull(CheckpointError):
    """A checkpoint step could not be written: its file system is full. Not retryable (jobs/train.py)."""


# torch.save's zip writer (DCP writes its non-tensor items with it) reports a short write without the errno:
# "[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598" (seen on the dev cluster, a full tmpfs).
SHORT_WRITE = re.compile(r"inline_container\.cc.*(unexpected pos|file write failed)", re.DOTALL)
SHORT_WRITE_FREE = 1 << 20  # a short write is the disk's when less than this (or 1/20 of a small one) is left


def is_disk_full(exc: BaseException, root: Path | None = None) -> bool:
    """Whether ``exc`` (DCP's gathered failures of every rank included) comes from a full file system: ENOSPC or
    EDQUOT, or (``root`` given) torch's zip writer's short write where ``root``'s file system is (nearly) full."""
    seen: set[int] = set()
    todo: list[BaseException] = [exc]
    while todo:
        e = todo.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if isinstance(e, CheckpointException):
            todo += [f for f in e.failures.values() if isinstance(f, BaseException)]
        todo += [c for c in (e.__cause__, e.__context__) if c is not None]
    text = str(exc)
    if "No space left on device" in text or "[Errno 28]" in text or "Disk quota exceeded" in text:
        return True
    return root is not None and SHORT_WRITE.search(text) is not None and _nearly_full(root)


def _nearly_full(root: Path) -> bool:
    try:
        usage = shutil.disk_usage(root)
    except OSError:
        return False
    return usage.free < min(SHORT_WRITE_FREE, usage.total // 20)


def _size(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.iterdir() if f.is_file()) if folder.is_dir() else 0


def disk_full(root: Path, step_dir: Path, step: int) -> DiskFull:
    """Rank 0: remove the half-written ``step_dir`` (marker first, as purge does) and say what happened."""
    written = _size(step_dir)
    (step_dir / MARKER).unlink(missing_ok=True)
    shutil.rmtree(step_dir, ignore_errors=True)
    committed = committed_steps(root)
    free = shutil.disk_usage(root).free if root.is_dir() else 0
    if committed:
        newest, newest_dir = committed[-1]
        need = f"a step needs about {_size(newest_dir)} bytes (step {newest}'s size)"
        resume = f"the newest committed checkpoint, step {newest}, is intact: a resume starts from it"
    else:
        need = f"{written} bytes of it were written before the disk filled"
        resume = "no checkpoint was committed yet: a restart starts over"
    return DiskFull(
        f"checkpoint step {step} could not be written: the file system of {root} is full (ENOSPC, "
        f"{os.strerror(errno.ENOSPC)}); "
        f"{free} bytes free there, {need}. The half-written step was removed and the run stops here; {resume}. "
        "Free space there (fewer checkpoint.keep_last) or set checkpoint.dir to a larger file system, then resume")
