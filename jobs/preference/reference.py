"""The reference model's log-probabilities of every answer: computed once, as a phase of the job, and cached.

DPO and KTO compare the policy with a frozen reference. With ``reference: cached`` (the default) the same FSDP2
ranks compute the reference's log-probability of every answer of the table before the first training step,
with the weights the run starts from (with LoRA: the base, the adapters off), and keep them in the run folder:
training then holds no second model, and every later step, restart and requeue reads the cache.

The pass goes through the table in fixed chunks of rows, each rank computing its own slice of a chunk; rank 0
writes each finished chunk as one file (write, then rename: a file that exists is whole), so a pass stopped by a
preemption, a crash or a time limit resumes at its first missing chunk. A stop signal is agreed on between
chunks: every rank leaves the same way a stop checkpoint hands off (there is no training step to save yet).
The folder is keyed by the table's fingerprint (its tokens) and what makes the reference (model, LoRA or not):
other data or another model never reads a stale cache.

With ``reference: live`` a frozen copy of the model (or, with LoRA, the same model with its adapters off)
computes the reference's log-probabilities of each micro-batch at every step instead.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist

from fsdpjob.orchestrator.core.fileio import write_atomic
from fsdpjob.orchestrator.core.runfolder import heartbeat

from .batches import answer_rows, concatenated_logps

log = logging.getLogger("fsdpjob.reference")

FOLDER = "reference"
CHUNK_ROWS_PER_RANK = 8  # rows each rank computes per chunk: a chunk of forward passes, written as one file


def cache_dir(run_dir: Path, fingerprint: str, model_key: str) -> Path:
    key = hashlib.sha256(f"{fingerprint}:{model_key}".encode()).hexdigest()[:16]
    return Path(run_dir) / FOLDER / key


@contextlib.contextmanager
def as_reference(model: torch.nn.Module, lora: bool) -> Iterator[None]:
    """The model as the reference: eval mode, no autograd, and with LoRA its adapters off (the base the adapters
    were trained on, no second model)."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), _adapters_off(model) if lora else contextlib.nullcontext():
            yield
    finally:
        model.train(was_training)


@contextlib.contextmanager
def _adapters_off(model: torch.nn.Module) -> Iterator[None]:
    """peft's own switch on each of its layers (the injected model keeps no PeftModel and its disable_adapter):
    LoRA layers, and the wrappers of ``modules_to_save`` (and trainable tokens), which are no tuner layers: left on,
    a trained ``lm_head`` copy stayed in the "reference" (logits 1.66 away from the base in a tiny check). Each then
    computes as the base; switching back restores the adapters' requires_grad as peft set it."""
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils.other import AuxiliaryTrainingWrapper

    layers = [m for m in model.modules() if isinstance(m, (BaseTunerLayer, AuxiliaryTrainingWrapper))]
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield
    finally:
        for layer in layers:
            layer.enable_adapters(True)


class ReferenceCache:
    """The reference log-probabilities of a table's answers: ``logps[row]`` is ``(chosen, rejected)`` for a pair
    table, ``(answer,)`` for an unpaired one, summed over the answer's tokens (fp32)."""

    def __init__(self, folder: Path, rows: int, width: int):
        self.folder, self.rows, self.width = folder, rows, width
        self.logps = torch.zeros(rows, width, dtype=torch.float32)

    def _chunk_path(self, index: int) -> Path:
        return self.folder / f"chunk-{index:06d}.pt"

    def load_written(self) -> set[int]:
        """The chunks written so far, loaded into ``logps``; their indices."""
        written = set()
        for path in sorted(self.folder.glob("chunk-*.pt")):
            saved = torch.load(path, weights_only=True)
            self.logps[saved["rows"]] = saved["logps"]
            written.add(int(path.stem.split("-")[1]))
        return written

    def write_chunk(self, index: int, rows: torch.Tensor, logps: torch.Tensor) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self._chunk_path(index)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        torch.save({"rows": rows.clone(), "logps": logps.clone()}, tmp)
        os.replace(tmp, path)

    def mark_complete(self, seconds: float, chunks: int) -> None:
        write_atomic(self.folder / "complete.json", json.dumps({"rows": self.rows, "chunks": chunks,
                                                                 "seconds": round(seconds, 3)}))

    @property
    def complete(self) -> bool:
        return (self.folder / "complete.json").is_file()

    def lookup(self, rows: torch.Tensor) -> torch.Tensor:
        return self.logps[rows]


def compute_reference(model: torch.nn.Module, table, cache: ReferenceCache, *, lora: bool, device: torch.device,
                      micro_batch_size: int, rank: int, world_size: int, is_main: bool,
                      stop_agreed: Callable[[], int], on_chunk: Callable[[int], None] | None = None) -> int:
    """Fill ``cache`` (every rank ends with the whole of it). Returns 0, or the stop signal every rank agreed on
    between two chunks (the pass's written chunks stay; the next start resumes at the first missing one)."""
    per_chunk = CHUNK_ROWS_PER_RANK * world_size
    chunks = -(-len(table) // per_chunk)
    written = cache.load_written()
    missing = [index for index in range(chunks) if index not in written]
    started = time.time()
    for done, index in enumerate(missing):
        heartbeat.enter(heartbeat.REFERENCE)
        first, last = index * per_chunk, min(len(table), (index + 1) * per_chunk)
        # Every rank computes the same number of rows (the last chunk's short slices are topped up with row 0:
        # the gather needs equal sizes, FSDP's gathers the same number of forwards), then drops the extra.
        mine = torch.arange(first + rank * CHUNK_ROWS_PER_RANK, first + (rank + 1) * CHUNK_ROWS_PER_RANK)
        valid = mine < last
        mine = torch.where(valid, mine, torch.zeros_like(mine))
        values = torch.zeros(len(mine), cache.width, dtype=torch.float32)
        with as_reference(model, lora):
            for at in range(0, len(mine), micro_batch_size):
                rows = mine[at:at + micro_batch_size]
                values[at:at + len(rows)] = reference_logps(model, table.micro_batch(rows), device, cache.width)
        gathered = _gather(values, world_size)
        rows_all = _gather(torch.where(valid, mine, torch.full_like(mine, -1)), world_size)  # int64: any row count
        keep = rows_all >= 0
        cache.logps[rows_all[keep]] = gathered[keep]
        if is_main:
            cache.write_chunk(index, rows_all[keep], gathered[keep])
        if on_chunk is not None:
            on_chunk(index)
        if done + 1 < len(missing) and (signum := stop_agreed()):
            return signum
    if is_main and missing:
        cache.mark_complete(time.time() - started, chunks)
    return 0


def reference_logps(model: torch.nn.Module, batch, device: torch.device, width: int) -> torch.Tensor:
    """[B, width] summed answer log-probabilities of a micro-batch (chosen and rejected, or the one answer)."""
    ids, labels = answer_rows(batch)
    logps, _ = concatenated_logps(model, ids, labels, device)
    return logps.float().cpu().view(width, -1).t() if width > 1 else logps.float().cpu().unsqueeze(1)


def _gather(values: torch.Tensor, world_size: int) -> torch.Tensor:
    if world_size == 1:
        return values
    out = [torch.empty_like(values) for _ in range(world_size)]
    dist.all_gather(out, values.to(_collective_device()))  # the default group: NCCL on GPUs
    return torch.cat([o.cpu() for o in out])


def _collective_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
