"""The memory tier's file format and its writer: DCP's metadata over raw bytes, so a snapshot costs one copy of each
tensor into shared memory.

Through DCP's own save, a snapshot cost ~0.5 s of CPU per rank at 19 M (bench/RESULTS.md, "Where a snapshot's CPU
goes"): the stager's copy into its buffers, DCP's planning and collectives, a torch.save record per tensor written
through write(), then the whole shard read back for the replica. Here DCP plans once per launch (``plan_layout``,
a dry run that writes nothing: the global plan, its de-duplication and the metadata every rank then keeps), and every
snapshot replays that plan: each tensor this rank saves is copied from the live state straight into its place in the
rank's file, mapped from /dev/shm (``fill``), and the file's pages are what the replica sends (memory/replicate.py).

A rank's file: its tensors' bytes as they are in memory (C order), each at a 64-byte aligned offset that stays the
same from snapshot to snapshot, then its pickled entries (LR scheduler, data position, RNG: DCP's BYTE_IO records,
whose lengths change) one after another. ``.metadata`` is DCP's, pickled as FileSystemWriter writes it, with these
offsets: a resume plans with DCP (any world size) and reads with ``RawReader``.
"""

from __future__ import annotations

import contextlib
import io
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, SavePlan, WriteItem, WriteItemType
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from fsdpjob.jobs.checkpoint.io import pread_into
from fsdpjob.orchestrator.core.runfolder.memtier import shard_name

from .node import TierNode, map_file

ALIGN = 64  # every tensor's offset: a multiple of any element size, and of a cache line


@dataclass(frozen=True)
class Slot:
    """Where one tensor this rank saves lies in its file."""

    item: WriteItem
    offset: int
    length: int


@dataclass
class Layout:
    """This rank's part of the plan DCP made for the launch's first snapshot, and the checkpoint's metadata (the same
    on every rank: its tensor entries hold for every snapshot, its pickled entries' places are patched in)."""

    name: str  # this rank's file
    tensors: list[Slot]
    blobs: list[WriteItem]  # pickled entries, written after the tensors
    tensor_bytes: int
    keys: frozenset[str]  # the flattened state's keys: a replay needs the same
    metadata: Metadata = field(repr=False)


def to_state_dict(state: dict[str, Any]) -> dict[str, Any]:
    """What dcp.save does to the state first: each Stateful as its state dict."""
    return {k: v.state_dict() if isinstance(v, Stateful) else v for k, v in state.items()}


class _DryRun(StorageWriter):
    """A DCP storage writer that writes nothing: it lays this rank's items out (tensors first, aligned) and keeps
    them; the pickled entries get a place per snapshot."""

    def __init__(self) -> None:
        self.layout: tuple[str, list[Slot], list[WriteItem], int] | None = None

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        pass

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return True

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        pass

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        from dataclasses import replace

        return [replace(plan, storage_data=shard_name(rank)) for rank, plan in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: Any) -> Future[list[WriteResult]]:
        name, tensors, blobs, end = plan.storage_data, [], [], 0
        for item in plan.items:
            if item.type == WriteItemType.BYTE_IO:
                blobs.append(item)
                continue
            chunk, dtype = item.tensor_data.chunk.sizes, item.tensor_data.properties.dtype
            length = chunk.numel() * dtype.itemsize
            tensors.append(Slot(item, end, length))
            end += -(-length // ALIGN) * ALIGN
        self.layout = name, tensors, blobs, end
        results = [WriteResult(s.item.index, s.length, _StorageInfo(name, s.offset, s.length)) for s in tensors]
        results += [WriteResult(b.index, 0, _StorageInfo(name, end, 0)) for b in blobs]  # placed per snapshot
        done: Future = Future()
        done.set_result(results)
        return done

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        metadata.storage_data = {r.index: r.storage_data for rank in results for r in rank}


def plan_layout(node: TierNode, state: dict[str, Any]) -> Layout:
    """DCP's save plan for ``state`` on the tier's group, nothing written (collective; once per launch, and again
    where the state's shape changed)."""
    flat = to_state_dict(state)
    dry = _DryRun()
    metadata = dcp.save(flat, storage_writer=dry, process_group=node.pg, no_dist=node.pg is None)
    assert dry.layout is not None  # write_data ran on every rank
    name, tensors, blobs, end = dry.layout
    planner = DefaultSavePlanner()
    planner.set_up_planner(flat)
    return Layout(name, tensors, blobs, end, frozenset(planner.state_dict), metadata)


@dataclass
class Pending:
    """One snapshot's sources, taken at save(): the live tensors (the optimizer step waits for their copy) and the
    pickled entries' bytes."""

    tensors: list[torch.Tensor]
    blobs: list[bytes]
    ready: Any = None  # CUDA: an event after the step that produced the tensors


def take(layout: Layout, state: dict[str, Any]) -> Pending | None:
    """The snapshot's sources by the launch's plan, or None where the state no longer matches it (other keys, a
    tensor of another shape or type: plan again)."""
    planner = DefaultSavePlanner()
    planner.set_up_planner(to_state_dict(state))
    if frozenset(planner.state_dict) != layout.keys:
        return None
    tensors = []
    for slot in layout.tensors:
        try:
            tensor = planner.resolve_data(slot.item)
        except ValueError:  # DCP's lookup: no such shard any more
            return None
        props = slot.item.tensor_data
        if tuple(tensor.shape) != tuple(props.chunk.sizes) or tensor.dtype != props.properties.dtype:
            return None
        tensors.append(tensor.detach())
    blobs = [bytes(planner.resolve_data(item).getbuffer()) for item in layout.blobs]
    ready = None
    if any(t.is_cuda for t in tensors):
        ready = torch.cuda.Event()
        ready.record()  # on the compute stream: after optimizer.step() and everything before it
    return Pending(tensors, blobs, ready)


@dataclass
class Filled:
    """A snapshot's file as written: its mapping (the replica is sent from it; None once the commit is over) and its
    pickled entries' places."""

    data: torch.Tensor | None
    blobs: list[WriteResult]


def fill(path: Path, layout: Layout, pending: Pending, reuse: Path | None = None) -> Filled:
    """Write the snapshot's file (in the tier's copy thread; ``reuse``: a dropped step's file to fill again):
    allocated whole first (ENOSPC here), each tensor copied into its place in the mapping, the pickled entries
    after them."""
    size = layout.tensor_bytes + sum(map(len, pending.blobs))
    data = map_file(path, size, reuse)
    # CUDA: the copies on a stream of their own, after the event, so they neither wait behind the next step's
    # kernels nor run before the step that produced the tensors (into pageable memory: each copy returns when done).
    stream = torch.cuda.Stream() if pending.ready is not None else None
    with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
        if stream is not None:
            stream.wait_event(pending.ready)
        for slot, tensor in zip(layout.tensors, pending.tensors):
            if slot.length:
                props = slot.item.tensor_data
                view = data[slot.offset: slot.offset + slot.length].view(props.properties.dtype).view(props.chunk.sizes)
                view.copy_(tensor)
    if stream is not None:
        stream.synchronize()
    results, offset = [], layout.tensor_bytes
    for item, blob in zip(layout.blobs, pending.blobs):
        data[offset: offset + len(blob)].copy_(torch.frombuffer(bytearray(blob), dtype=torch.uint8))
        results.append(WriteResult(item.index, len(blob), _StorageInfo(layout.name, offset, len(blob))))
        offset += len(blob)
    return Filled(data, results)


def metadata_with(layout: Layout, blobs: list[list[WriteResult]]) -> Metadata:
    """The launch's metadata with this snapshot's places of every rank's pickled entries."""
    metadata = layout.metadata
    for rank in blobs:
        for result in rank:
            metadata.storage_data[result.index] = result.storage_data
    return metadata


class RawReader(FileSystemReader):
    """Reads the tier's files: each tensor's raw bytes (the saved chunk's shape and type from the metadata), straight
    into the destination where the plan wants the whole chunk there, else through a copy narrowed to the part it
    wants (a resharded load); pickled entries as DCP reads them."""

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        self._chunks = {
            (fqn, tuple(chunk.offsets)): (chunk.sizes, md.properties.dtype)
            for fqn, md in metadata.state_dict_metadata.items() if isinstance(md, TensorStorageMetadata)
            for chunk in md.chunks
        }  # fmt: skip

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        per_file: dict[str, list[Any]] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        for relative_path, items in per_file.items():
            items.sort(key=lambda item: self.storage_data[item.storage_index].offset)
            fd = os.open(Path(self.path) / relative_path, os.O_RDONLY)
            try:
                for item in items:
                    self._read(fd, item, planner)
            finally:
                os.close(fd)
        done: Future = Future()
        done.set_result(None)
        return done

    def _read(self, fd: int, item: Any, planner: LoadPlanner) -> None:
        info: _StorageInfo = self.storage_data[item.storage_index]
        if item.type == LoadItemType.BYTE_IO:
            blob = torch.empty(info.length, dtype=torch.uint8)
            pread_into(fd, blob, info.offset)
            planner.load_bytes(item, io.BytesIO(blob.numpy().tobytes()))
            return
        index: MetadataIndex = item.storage_index
        sizes, dtype = self._chunks[(index.fqn, tuple(index.offset))]
        if info.length != sizes.numel() * dtype.itemsize:
            raise ValueError(f"{info.relative_path}: {index.fqn} has {info.length} bytes, its chunk {sizes} of "
                             f"{dtype} needs {sizes.numel() * dtype.itemsize}")
        target = planner.resolve_tensor(item).detach()
        whole = all(o == 0 for o in item.storage_offsets) and tuple(item.lengths) == tuple(sizes)
        if whole and target.device.type == "cpu" and target.is_contiguous() and target.dtype == dtype:
            pread_into(fd, target, info.offset)
        else:
            saved = torch.empty(sizes, dtype=dtype)
            pread_into(fd, saved, info.offset)
            target.copy_(narrow_tensor_by_index(saved, item.storage_offsets, item.lengths))
        planner.commit_tensor(item, target)
