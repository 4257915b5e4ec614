"""Checksums of a durable checkpoint's files: each rank's shard summed while it is written (one pass over the bytes
on their way to the disk, no read-back), the ranks' sums folded into the step's commit record, and checked again
before the step is loaded, so a flipped byte or a cut file is never loaded.

torch.save's own CRC32 is off around our writes (io.py: torch.load never checks it); this sum is the one that is
checked. CRC32 (zlib, ~1 GB/s a core here, the GIL released) over a stronger hash: it catches every burst error up to
32 bits and any single flipped byte, and a corrupted checkpoint is an accident, not an attack.
"""

from __future__ import annotations

import io
import json
import os
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from fsdpjob.orchestrator.core.fileio import file_crc32, write_atomic
from fsdpjob.orchestrator.core.runfolder.ckptlayout import MARKER

ALGORITHM = "crc32"


RANK_SUMS_GLOB = "checksums-*.json"


def rank_sums_name(rank: int) -> str:
    """The file in which rank ``rank`` records its files' sums, before rank 0 commits the step."""
    return f"checksums-{rank}.json"


# Writes at least this large are summed in a second thread while the write itself runs (both release the GIL): the
# sum then costs CPU but little wall time. Smaller ones are summed inline (a hand-off costs more than it saves).
OVERLAP_BYTES = 1 << 20


class SummedFile(io.FileIO):
    """A file opened for writing that keeps the CRC32 and the length of what it wrote. A large write is summed in a
    helper thread during the write call (the caller's buffer is unchanged until the call returns, which waits for
    the sum), so a save pays max(write, sum), not their total."""

    def __init__(self, path: str | os.PathLike, mode: str) -> None:
        super().__init__(path, mode)
        self.crc = 0
        self.size = 0
        self._summer: ThreadPoolExecutor | None = None

    def write(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        if len(view) < OVERLAP_BYTES:
            written = super().write(view)
            if written:
                self.crc = zlib.crc32(view[:written], self.crc)
        else:
            if self._summer is None:
                self._summer = ThreadPoolExecutor(1, thread_name_prefix="checkpoint-crc32")
            whole = self._summer.submit(zlib.crc32, view, self.crc)
            written = super().write(view)
            crc = whole.result()
            # A short write (rare on a regular file): the sum of what was written, done again.
            self.crc = crc if written == len(view) else zlib.crc32(view[:written or 0], self.crc)
        self.size += written or 0
        return written

    def close(self) -> None:
        try:
            super().close()
        finally:
            if self._summer is not None:
                self._summer.shutdown(wait=False)
                self._summer = None


def write_rank_sums(step_dir: Path, rank: int, sums: dict[str, tuple[int, int]]) -> None:
    """Record this rank's files' (size, crc32), fsynced, before the rank reports its write to DCP (so before the
    coordinator writes .metadata, and long before the commit)."""
    record = {"algorithm": ALGORITHM, "files": {name: list(sums[name]) for name in sorted(sums)}}
    write_atomic(step_dir / rank_sums_name(rank), json.dumps(record) + "\n")


def commit_sums(step_dir: Path, extra: list[str]) -> dict[str, Any]:
    """Rank 0 at the commit: every rank's recorded sums (read, then removed: the commit record holds them now) and
    the sums of ``extra`` (small files rank 0 wrote itself: .metadata, the sidecar), read once."""
    files: dict[str, list[int]] = {}
    for path in sorted(step_dir.glob(RANK_SUMS_GLOB)):
        files.update(json.loads(path.read_text())["files"])
    for name in extra:
        files[name] = list(file_crc32(step_dir / name))
    return {"algorithm": ALGORITHM, "files": files}


def drop_rank_sums(step_dir: Path) -> None:
    for path in step_dir.glob(RANK_SUMS_GLOB):
        path.unlink(missing_ok=True)


def recorded_sums(step_dir: Path) -> dict[str, list[int]] | None:
    """The (size, crc32) of every file the step's commit record sums; None for a step committed without sums (by
    an fsdpjob before them) or whose record is unreadable (the marker check reports that)."""
    try:
        record = json.loads((step_dir / MARKER).read_text())
    except (OSError, ValueError):
        return None
    sums = record.get("checksums") if isinstance(record, dict) else None
    if not isinstance(sums, dict) or sums.get("algorithm") != ALGORITHM or not isinstance(sums.get("files"), dict):
        return None
    return sums["files"]


def size_damage(step_dir: Path, sums: dict[str, list[int]]) -> str | None:
    """Why the step's files differ from their recorded sizes (cheap: no byte read), or None."""
    for name, (size, _) in sorted(sums.items()):
        path = step_dir / name
        if not path.is_file():
            return f"{name} is missing"
        actual = path.stat().st_size
        if actual != size:
            return f"{name} is {'truncated' if actual < size else 'longer than written'} ({actual} bytes, {size} " \
                   "written)"
    return None


def content_damage(step_dir: Path, sums: dict[str, list[int]], names: list[str]) -> str | None:
    """Why one of ``names`` no longer has the bytes that were written (its size or its crc32 differs), or None."""
    for name in names:
        size, crc = sums[name]
        try:
            actual_size, actual_crc = file_crc32(step_dir / name)
        except OSError as exc:
            return f"{name} cannot be read ({exc})"
        if actual_size != size:
            return f"{name} is {actual_size} bytes, {size} were written"
        if actual_crc != crc:
            return f"{name} fails its checksum (crc32 {actual_crc:08x}, {crc:08x} written): its bytes changed on disk"
    return None
