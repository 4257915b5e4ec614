"""File helpers both sides share: atomic writes (registry, run folder, checkpoint commits) and tailing a growing
file."""

from __future__ import annotations

import os
from pathlib import Path


def write_atomic(path: Path, text: str, mode: int = 0o600) -> None:
    """Write-then-rename so that a reader never sees a half-written file, even under SIGKILL.

    The folder is fsynced after the rename: a checkpoint's commit marker must survive a node crash
    once the writer has gone on (a marker lost after its step was purged would lose the run's state).
    """
    import tempfile  # here: 5 ms (shutil, random) a command that writes nothing need not pay

    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


CRC_READ_CHUNK = 8 << 20  # bytes per read when summing a file: large reads, a bounded buffer


def file_crc32(path: Path) -> tuple[int, int]:
    """(size, CRC32) of a file as it is now (the checkpoint checksums: jobs/checkpoint/checksum.py, the memory
    tier's parts)."""
    import zlib

    crc = size = 0
    buffer = bytearray(CRC_READ_CHUNK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as stream:
        while n := stream.readinto(buffer):
            crc = zlib.crc32(view[:n], crc)
            size += n
    return size, crc


class Tail:
    """New complete lines of a growing text file (a line still being written waits for its newline)."""

    def __init__(self, path: Path):
        self.path, self.offset, self.partial = path, 0, ""

    def lines(self) -> list[str]:
        try:
            with open(self.path, encoding="utf-8", errors="replace") as f:
                f.seek(self.offset)
                data = f.read()
                self.offset = f.tell()
        except OSError:
            return []
        *complete, self.partial = (self.partial + data).split("\n")
        return complete
