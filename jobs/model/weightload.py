"""Every rank reads only its own FSDP2 shards of the safetensors weights: no rank holds the full model, nothing
is broadcast.

The safetensors header gives each tensor's dtype, shape and byte range. FSDP2 shards dim 0 (torch.chunk:
ceil(rows / ranks) rows per rank, the last ones shorter or empty; padded in storage only), so a rank's part of
a row-major tensor is one contiguous byte range, found from the DTensor's own placements
(compute_local_shape_and_global_offset) rather than from a guess at FSDP's arithmetic. Each range is read with
one pread straight into the shard's memory when the file already holds the parameter's dtype and the shard is
in host memory, else into a buffer of one shard that ``copy_`` casts (bf16 file -> fp32 master weights, the
same rounding as the broadcast path) or moves to the GPU. Reads go through the page cache, not a mapping of
the file: safetensors' own ``get_slice`` maps it, and every page a rank touches then counts in its resident
set until the file closes (measured: +0.5x the model on each of 2 ranks, on top of its shards).

Where this cannot be exact, load_model keeps the rank-0 read and broadcast: weights that are not safetensors,
stored names it cannot map onto the model by its base-model prefix (checkpoints transformers converts on load),
shards that are not dim-0 ranges, or FSDPJOB_WEIGHT_LOAD=rank0. All ranks take the same path: they agree first,
and any rank's read error fails every rank instead of leaving the others waiting in a collective.
"""

from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from fsdpjob.orchestrator.core import envvars
from fsdpjob.orchestrator.core.weightfiles import read_header, weight_files

from ..checkpoint.io import pread_into

log = logging.getLogger("fsdpjob.jobs.weightload")

SWITCH = "FSDPJOB_WEIGHT_LOAD"  # "rank0": read on rank 0 and broadcast, as before; unset or "sharded": this path
CHECKPOINT_WRAPPER = "_checkpoint_wrapped_module."  # activation checkpointing's module, not in file names
_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}  # fmt: skip


@dataclass(frozen=True)
class StoredTensor:
    """One tensor of a safetensors file: where its bytes start (absolute file offset), its dtype and shape."""

    file: Path
    start: int
    dtype: torch.dtype
    shape: tuple[int, ...]


@dataclass(frozen=True)
class Piece:
    """What one rank reads for one parameter or buffer: rows [row0, row0 + rows) of a stored tensor."""

    name: str
    target: torch.Tensor  # the local shard (or the whole buffer), written in place
    stored: StoredTensor
    row0: int


def stored_tensors(model_dir: Path) -> dict[str, StoredTensor] | None:
    """Every tensor of the folder's safetensors weights (sharded with an index, or one file); None without any."""
    files = weight_files(model_dir)
    if files is None:
        return None
    tensors: dict[str, StoredTensor] = {}
    for path in files:
        header, data_start = read_header(path)
        for key, entry in header.items():
            if entry["dtype"] not in _DTYPES:
                raise ValueError(f"{path}: tensor {key} has dtype {entry['dtype']}, which fsdpjob does not read")
            begin, end = entry["data_offsets"]
            stored = StoredTensor(path, data_start + begin, _DTYPES[entry["dtype"]], tuple(entry["shape"]))
            if end - begin != math.prod(stored.shape) * stored.dtype.itemsize:
                raise ValueError(f"{path}: tensor {key}: its byte range does not match its shape and dtype")
            tensors[key] = stored
    return tensors


def map_names(expected: set[str], stored: set[str], tie_groups: list[list[str]], prefix: str) -> dict[str, str] | None:
    """File key of every state-dict key, or None unless every key has one and every file key is used.

    Tried as stored, then without and with the model's base-model prefix (a checkpoint of the bare ``LlamaModel``
    has ``layers.0...`` where ``LlamaForCausalLM`` has ``model.layers.0...``: transformers maps it the same way);
    a tied name takes its twin's tensor. Anything else (renamed or fused tensors) is left to transformers.
    """
    twins = {name: group for group in tie_groups for name in group}
    renames = [lambda k: k]
    if prefix:
        renames += [lambda k: k[len(prefix) + 1 :] if k.startswith(prefix + ".") else k, lambda k: f"{prefix}.{k}"]
    for rename in renames:
        found: dict[str, str] = {}
        for key in expected:
            candidates = [rename(k) for k in twins.get(key, [key])]
            hit = rename(key) if rename(key) in stored else next((c for c in candidates if c in stored), None)
            if hit is None:
                break
            found[key] = hit
        else:
            if set(found.values()) == stored:
                return found
    return None


def _local_region(tensor: torch.Tensor) -> tuple[torch.Tensor, int, tuple[int, ...]] | None:
    """(local tensor, first global row, local shape) of a parameter or buffer; None unless it is a dim-0 range."""
    if not isinstance(tensor, DTensor):
        return tensor.detach(), 0, tuple(tensor.shape)
    local = tensor.to_local().detach()  # the shard's own memory (FSDP2: a view of its padded storage)
    shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    if tuple(local.shape) != tuple(shape) or any(offset[1:]) or tuple(shape[1:]) != tuple(tensor.shape[1:]):
        return None
    return local, offset[0] if shape else 0, tuple(shape)


@torch.no_grad()
def plan_pieces(model: nn.Module, path: Path, expected: set[str], tie_groups: list[list[str]],
                ignore: set[str] = frozenset()) -> list[Piece] | str:
    """What this rank reads, or why the sharded path does not apply (every rank sees the same answer); stored
    tensors named in ``ignore`` are not the model's (a reward model's backbone leaves the LM head unread)."""
    if envvars.get(SWITCH, "sharded") == "rank0":
        return f"{SWITCH}=rank0"
    stored = stored_tensors(path)
    if stored is None:
        return "no safetensors weights"
    names = map_names(expected, set(stored) - ignore, tie_groups, getattr(model, "base_model_prefix", "") or "")
    if names is None:
        return "the stored names do not map onto the model's"
    pieces: list[Piece] = []
    params = [(n.replace(CHECKPOINT_WRAPPER, ""), p) for n, p in model.named_parameters()]
    buffers = [(n.replace(CHECKPOINT_WRAPPER, ""), b) for n, b in model.named_buffers() if b is not None]
    twins = {name: group for group in tie_groups for name in group}
    covered = {twin for name, _ in params + buffers for twin in twins.get(name, [name])}
    strays = sorted(n for n, _ in params if n not in expected) + sorted(expected - covered)
    if strays:
        return f"{strays[0]}: not both a model tensor and a state-dict key"
    for name, tensor in params + [(n, b) for n, b in buffers if n in expected]:  # other buffers are recomputed
        source = stored[names[name]]
        region = _local_region(tensor)
        if region is None or source.shape != tuple(tensor.shape):
            return f"{name}: its shard is not a dim-0 range of the stored tensor"
        local, row0, shape = region
        if math.prod(shape):
            pieces.append(Piece(name, local, source, row0))
    return pieces


@torch.no_grad()
def read_pieces(pieces: list[Piece]) -> int:
    """Read every piece into its target, in file order; returns the bytes read."""
    fds: dict[Path, int] = {}
    total = 0
    try:
        for piece in sorted(pieces, key=lambda p: (str(p.stored.file), p.stored.start)):
            stored, target = piece.stored, piece.target
            fd = fds.get(stored.file)
            if fd is None:
                fd = fds[stored.file] = os.open(stored.file, os.O_RDONLY)
            row_bytes = math.prod(stored.shape[1:]) * stored.dtype.itemsize
            direct = target.device.type == "cpu" and target.dtype == stored.dtype and target.is_contiguous()
            buffer = target if direct else torch.empty(target.shape, dtype=stored.dtype)
            pread_into(fd, buffer, stored.start + piece.row0 * row_bytes)
            if not direct:
                target.copy_(buffer)
            total += buffer.numel() * stored.dtype.itemsize
    finally:
        for fd in fds.values():
            os.close(fd)
    return total


def _agree(failure: str | None) -> list[tuple[int, str]]:
    """Every rank's failure (rank, text), the same list on all ranks."""
    if not (dist.is_available() and dist.is_initialized()):
        return [(0, failure)] if failure else []
    failures: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(failures, failure)
    return [(rank, text) for rank, text in enumerate(failures) if text]


def load_sharded(model: nn.Module, path: Path, expected: set[str], tie_groups: list[list[str]],
                 ignore: set[str] = frozenset()) -> bool:
    """Fill the materialized sharded model from the safetensors at ``path``, each rank its own shards (collective).

    False (nothing read, on every rank) when the sharded path does not apply: the caller then reads on rank 0
    and broadcasts. A read error on any rank raises on every rank.
    """
    try:
        planned = plan_pieces(model, path, expected, tie_groups, ignore)
    except Exception as exc:  # an unreadable header: the rank-0 path reports it its own way
        planned = f"{type(exc).__name__}: {exc}"
    reasons = _agree(planned if isinstance(planned, str) else None)
    if reasons:
        log.info("weights of %s: rank-0 read and broadcast (%s)", path, reasons[0][1])
        return False
    assert not isinstance(planned, str)
    started = time.monotonic()
    failure = None
    try:
        nbytes = read_pieces(planned)
    except Exception as exc:  # relayed to every rank below
        failure = f"{type(exc).__name__}: {exc}"
    errors = _agree(failure)
    if errors:
        rank, text = errors[0]
        raise RuntimeError(f"rank {rank} could not read its shards of the model weights in {path}: {text}")
    log.info("read %.1f MB of %s (own shards) in %.2f s", nbytes / 1e6, path, time.monotonic() - started)
    return True
