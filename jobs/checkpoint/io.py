"""DCP storage writer and reader that run near the disk's speed; the files stay plain DCP (torch.save records).

Where a stock save and load lost their time (bench/checkpoint_io.py, profiled on 2 gloo ranks):

* save: torch.save computes a CRC32 of every tensor record, about half of the time spent before the fsync,
  yet torch.load never checks it (a flipped byte loads silently), so it buys no safety: it is turned off
  around our writes, and the records stay readable by any torch. The kernel only starts writing dirty
  pages back at its own thresholds, so the final fsync waited for nearly the whole file: the writer asks
  for write-back every few tens of MB while it goes on filling the page cache, and the fsync at the end
  (still there, still before DCP reports the write) finds little left to do.
* load: each record went through torch.load into a fresh tensor, then was copied into the parameter or
  optimizer state, in whatever order the plan listed them. The reader reads each record's bytes straight
  into the destination tensor (one pread, no copy) where that is the whole saved tensor, in file order;
  anything else (a resharded slice, another dtype, a GPU tensor, pickled bytes) takes DCP's own path.
"""

from __future__ import annotations

import io
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.utils import _create_file_view
from torch.futures import Future
from torch.utils.serialization import config as serialization_config

from fsdpjob.orchestrator.core import envvars

from .checksum import SummedFile, write_rank_sums

# Start write-back after this many new bytes: large enough for the disk to get long sequential runs, small
# enough that little is left for the fsync.
WRITEBACK_BYTES = 32 << 20
SWITCH = "FSDPJOB_CHECKPOINT_IO"  # "stock": DCP's own FileSystemWriter/Reader behaviour (same files either way)

_crc_lock = threading.Lock()
_crc_writers = 0  # writes in progress that turned the CRC off
_crc_before = True  # the setting to restore when the last one finishes


def fast_io() -> bool:
    return envvars.get(SWITCH, "fast") != "stock"


@contextmanager
def _without_crc32() -> Iterator[None]:
    """torch.save without its CRC32 while we write. The setting is process-wide, so overlapping writes (an async
    save's thread and a sync save) are counted and the last one restores it."""
    global _crc_writers, _crc_before
    with _crc_lock:
        if _crc_writers == 0:
            _crc_before = serialization_config.save.compute_crc32
            serialization_config.save.compute_crc32 = False
        _crc_writers += 1
    try:
        yield
    finally:
        with _crc_lock:
            _crc_writers -= 1
            if _crc_writers == 0:
                serialization_config.save.compute_crc32 = _crc_before


class _WritebackFile(SummedFile):
    """A file that starts the kernel's write-back of what it wrote every WRITEBACK_BYTES (and sums it, SummedFile).

    posix_fadvise(DONTNEED) starts asynchronous write-back of the dirty pages in its range and drops the clean
    ones: each call covers the new bytes and the window before them, written back by then, so a checkpoint does
    not fill the page cache (on a Slurm node, the job's memory cgroup) with gigabytes that only the final fsync
    would have flushed. Durability still comes from that fsync, which DCP runs before it reports the file.
    """

    def __init__(self, path: str | os.PathLike, mode: str) -> None:
        super().__init__(path, mode)
        self._behind = self._started = 0  # write-back requested for [0, _started); [0, _behind) also dropped

    def write(self, b: Any) -> int:
        written = super().write(b)
        end = self.tell()
        if written and end - self._started >= WRITEBACK_BYTES:
            os.posix_fadvise(self.fileno(), self._behind, end - self._behind, os.POSIX_FADV_DONTNEED)
            self._behind, self._started = self._started, end
        return written


class _SummingFileSystem(FileSystem):
    """DCP's file system whose written files are summed on their way to the disk (checksum.py); ``sums``: file name
    -> (size, crc32) of each file written whole. ``writeback``: with early write-back (_WritebackFile)."""

    def __init__(self, writeback: bool) -> None:
        super().__init__()
        self.writeback = writeback
        self.sums: dict[str, tuple[int, int]] = {}

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[io.IOBase]:
        if mode != "wb":
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        raw = (_WritebackFile if self.writeback else SummedFile)(path, "w")
        with io.BufferedWriter(raw) as stream:
            yield stream
        self.sums[Path(path).name] = (raw.size, raw.crc)  # only once written whole (no exception above)


class CheckpointWriter(FileSystemWriter):
    """FileSystemWriter (fsync on, one file per rank) without torch.save's unused CRC32, with early write-back, and
    with a CRC32 of each file taken while it is written, which the rank records beside its shard before it reports
    the write (checksum.py; rank 0 folds the ranks' records into the commit record).

    One writer thread per rank (DCP's default): a second one splits the rank's shard into two files and, measured
    on 2 cores, costs more CPU time than it saves in wall time.
    """

    def __init__(self, path: str | os.PathLike, *, rank: int = 0, fast: bool | None = None) -> None:
        super().__init__(path)
        self.fast = fast_io() if fast is None else fast
        self.rank = rank
        self.fs = _SummingFileSystem(writeback=self.fast and hasattr(os, "posix_fadvise"))
        # An async save writes from DCP's thread, which starts on GPU 0: bind it to this rank's device.
        self._device = torch.cuda.current_device() if torch.cuda.is_available() else None

    def write_data(self, plan: Any, planner: Any) -> Future:
        if self._device is not None:
            torch.cuda.set_device(self._device)
        if not self.fast:
            written = super().write_data(plan, planner)
        else:
            with _without_crc32():
                written = super().write_data(plan, planner)
        written.wait()  # FileSystemWriter writes before it returns; a failed write raises here, before any sum
        shards = {name: summed for name, summed in self.fs.sums.items() if not name.endswith(".tmp")}
        write_rank_sums(Path(self.path), self.rank, shards)
        return written


def plain_writer(step_dir: Path, *, rank: int, step: int) -> CheckpointWriter:
    """The production storage writer of one rank's save (the CheckpointManager's default)."""
    return CheckpointWriter(str(step_dir), rank=rank)


def pread_into(fd: int, target: torch.Tensor, offset: int) -> None:
    """Fill the contiguous CPU tensor ``target`` with the bytes of ``fd`` from ``offset`` (no intermediate buffer)."""
    view = memoryview(target.view(-1).view(torch.uint8).numpy())
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            raise OSError(f"unexpected end of file at byte {offset + done}")
        done += n


class CheckpointReader(FileSystemReader):
    """FileSystemReader that reads whole saved tensors straight into their destination, in file order."""

    def __init__(self, path: str | os.PathLike, *, fast: bool | None = None) -> None:
        super().__init__(path)
        self.fast = fast_io() if fast is None else fast

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future:
        if not self.fast:
            return super().read_data(plan, planner)
        per_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        for relative_path, items in per_file.items():
            items.sort(key=lambda item: self.storage_data[item.storage_index].offset)
            with open(Path(self.path) / relative_path, "rb") as stream:
                for item in items:
                    if not self._read_direct(stream, item, planner):
                        self._read_stock(stream, item, planner)
        done: Future = Future()
        done.set_result(None)
        return done

    def _read_direct(self, stream: io.BufferedReader, item: ReadItem, planner: LoadPlanner) -> bool:
        """Read one tensor record into its destination with one pread; False where DCP's own path must do it."""
        info = self.storage_data[item.storage_index]
        if item.type == LoadItemType.BYTE_IO or info.transform_descriptors:
            return False
        # map_location="meta" reads only the record's pickle and zip headers: the saved tensor's layout and
        # where its bytes start inside the record.
        saved = torch.load(_create_file_view(stream, info.offset, info.length), map_location="meta", weights_only=True)
        start = getattr(saved.untyped_storage(), "_checkpoint_offset", None)
        target = planner.resolve_tensor(item).detach()
        whole = all(o == 0 for o in item.storage_offsets) and tuple(item.lengths) == tuple(saved.shape)
        if not (
            start is not None and whole and saved.is_contiguous() and target.is_contiguous()
            and target.device.type == "cpu" and target.dtype == saved.dtype and target.shape == saved.shape
        ):
            return False
        nbytes = target.numel() * target.element_size()
        begin = start + saved.storage_offset() * saved.element_size()
        if begin + nbytes > info.length:
            raise ValueError(f"{info.relative_path}: record of {item.storage_index.fqn} is shorter than its tensor")
        pread_into(stream.fileno(), target, info.offset + begin)
        planner.commit_tensor(item, target)
        return True

    def _read_stock(self, stream: io.BufferedReader, item: ReadItem, planner: LoadPlanner) -> None:
        """DCP's FileSystemReader.read_data for one item (same calls, same checks)."""
        from torch.distributed._shard._utils import narrow_tensor_by_index

        info = self.storage_data[item.storage_index]
        source = self.transforms.transform_load_stream(
            item, info.transform_descriptors or (), _create_file_view(stream, info.offset, info.length)
        )
        if item.type == LoadItemType.BYTE_IO:
            planner.load_bytes(item, io.BytesIO(source.read(-1)))
            return
        seekable = source if source.seekable() else io.BytesIO(source.read(-1))
        tensor = narrow_tensor_by_index(
            torch.load(seekable, map_location="cpu", weights_only=True), item.storage_offsets, item.lengths
        )
        target = planner.resolve_tensor(item).detach()
        if target.size() != tensor.size():
            raise AssertionError(f"req {item.storage_index} mismatch sizes {target.size()} vs {tensor.size()}")
        target.copy_(tensor)
        planner.commit_tensor(item, target)
