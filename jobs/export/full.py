"""Export a DCP checkpoint's model weights to a Hugging Face folder (sharded safetensors), a shard at a time."""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from fsdpjob.orchestrator.core.runfolder.sidecar import Sidecar

from ..checkpoint.manager import select_checkpoint
from .hfdir import (
    DTYPE_NAMES,
    DTYPES,
    ExportError,
    copy_side_files,
    load_group,
    model_entries,
    write_config,
    write_shards,
)
from .lora import lora_writer

SCORE_HEAD = "score"  # transformers' sequence classifier's head (jobs/model/scorehead.HEAD)

log = logging.getLogger("fsdpjob.export")


def export_hf(
    step_dir: Path, model_dir: Path, out_dir: Path, dtype: str = "bf16", max_shard_bytes: int = 2**30,
    merge: bool = False,
) -> Path:
    """Write ``out_dir`` as a Hugging Face model folder from the model weights of a DCP step folder.

    Loads at most one shard's worth of tensors at a time; no consolidated file is written. The
    folder appears atomically (written next to it, then renamed). Returns ``out_dir``.
    A LoRA checkpoint gives a peft adapter folder, or with ``merge`` the base model with the adapters merged in
    (jobs/export/lora.py).
    """
    step_dir, model_dir, out_dir = Path(step_dir), Path(model_dir), Path(out_dir)
    run = Sidecar.read(step_dir).run
    lora = run.lora
    if merge and lora is None:
        raise ExportError(f"{step_dir}: --merge applies to LoRA checkpoints and this one holds every weight; "
                          "export it without --merge")
    write = _write_folder if lora is None else lora_writer(lora, merge, run.quantize)
    if dtype not in DTYPES:
        raise ExportError(f"unknown export dtype {dtype!r}; use one of {', '.join(DTYPES)}")
    target = DTYPES[dtype]
    if not (model_dir / "config.json").is_file():
        raise ExportError(f"{model_dir}: no config.json; pass the original Hugging Face model folder")
    if out_dir.exists() and any(out_dir.iterdir()):
        raise ExportError(f"{out_dir}: exists and is not empty; choose another output folder or remove it")
    staging = out_dir.with_name(f".{out_dir.name}.partial-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        shard_count = write(step_dir, model_dir, staging, target, max_shard_bytes)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if out_dir.exists():
        out_dir.rmdir()
    os.replace(staging, out_dir)
    log.info("exported %s to %s (%s, %d shards)", step_dir, out_dir, DTYPE_NAMES[target], shard_count)
    return out_dir


def _write_folder(step_dir: Path, model_dir: Path, out: Path, target: torch.dtype, max_shard_bytes: int) -> int:
    prefix, entries = model_entries(step_dir)
    # A reward model's checkpoint holds the sequence classifier's head (jobs/model/scorehead.py), no LM head.
    config = write_config(model_dir, out, target, classifier=f"{SCORE_HEAD}.weight" in entries)
    if config.get("tie_word_embeddings", False):
        entries.pop("lm_head.weight", None)  # from_pretrained re-ties it to the input embeddings
    sizes = {n: _export_nbytes(m, target) for n, m in entries.items()}
    count = write_shards(out, sizes, lambda names: load_group(step_dir, prefix, entries, names), target,
                         max_shard_bytes)
    copy_side_files(model_dir, out)
    return count


def _export_nbytes(meta: TensorStorageMetadata, target: torch.dtype) -> int:
    dtype = target if meta.properties.dtype.is_floating_point else meta.properties.dtype
    return meta.size.numel() * dtype.itemsize


def export_from_path(path: Path, out_dir: Path, dtype: str = "bf16", model_dir: Path | None = None,
                     merge: bool = False) -> Path:
    """Export from a step folder, a checkpoint root, or a run folder (newest verified step).

    The original model folder defaults to the ``model_path`` recorded in the checkpoint's sidecar.
    Returns the step folder that was exported.
    """
    step_dir = select_checkpoint(Path(path))
    if model_dir is None:
        recorded = Sidecar.read(step_dir).run.model_path
        if not recorded:
            raise ExportError(f"{step_dir}: the checkpoint does not record the model folder; pass it with --model-dir")
        model_dir = Path(recorded)
    export_hf(step_dir, Path(model_dir), Path(out_dir), dtype, merge=merge)
    return step_dir
