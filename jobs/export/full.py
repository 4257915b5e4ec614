"""Export a DCP checkpoint's model weights to a Hugging Face folder (sharded safetensors), a shard at a time."""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from ..checkpoint.manager import SIDECAR, CheckpointError, read_sidecar, select_checkpoint, single_process_dcp
from ..model.build import side_files

log = logging.getLogger("fsdpjob.export")

DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp32": torch.float32, "float32": torch.float32}
_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float32: "float32"}

class ExportError(CheckpointError):
    """The export cannot be done as asked (missing model folder, output folder in the way, ...)."""


def _model_prefix(step_dir: Path, fqns: list[str]) -> str:
    """'<key>.model.' where the ModelOptimState sits: from the sidecar, else the one key with .model and .optim."""
    key = read_sidecar(step_dir).get("model_key")
    if key is None:
        tops = {f.split(".", 2)[0] for f in fqns if f.count(".") >= 2 and f.split(".", 2)[1] == "model"}
        with_optim = sorted(t for t in tops if any(f.startswith(f"{t}.optim.") for f in fqns))
        key = with_optim[0] if len(with_optim) == 1 else None
    if key is None:
        raise ExportError(f"{step_dir}: cannot tell which entry holds the model weights (no model_key in {SIDECAR})")
    return f"{key}.model."


def _model_entries(step_dir: Path) -> tuple[str, dict[str, TensorStorageMetadata]]:
    """The weights' key prefix in the checkpoint, and their metadata by Hugging Face name."""
    tensors = {
        fqn: meta
        for fqn, meta in FileSystemReader(str(step_dir)).read_metadata().state_dict_metadata.items()
        if isinstance(meta, TensorStorageMetadata)
    }
    prefix = _model_prefix(step_dir, list(tensors))
    entries = {fqn[len(prefix) :]: meta for fqn, meta in tensors.items() if fqn.startswith(prefix)}
    if not entries:
        raise ExportError(f"{step_dir}: no model weights under '{prefix}*' in the checkpoint metadata")
    return prefix, entries


def _plan_shards(sizes: dict[str, int], max_shard_bytes: int) -> list[list[str]]:
    """Group names in checkpoint order into shards of at most max_shard_bytes (a bigger tensor goes alone)."""
    shards: list[list[str]] = [[]]
    used = 0
    for name, size in sizes.items():
        if shards[-1] and used + size > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += size
    return shards


def _load_group(
    step_dir: Path, prefix: str, entries: dict[str, TensorStorageMetadata], names: list[str]
) -> dict[str, torch.Tensor]:
    # Empty full-size tensors for just these keys; DCP reads the matching chunks from every rank's file.
    wanted = {prefix + n: torch.empty(entries[n].size, dtype=entries[n].properties.dtype) for n in names}
    with single_process_dcp():
        dcp.load(wanted, storage_reader=FileSystemReader(str(step_dir)), no_dist=True)
    return {n: wanted[prefix + n] for n in names}


def _write_config(model_dir: Path, out_dir: Path, dtype: torch.dtype) -> dict[str, Any]:
    config = json.loads((model_dir / "config.json").read_text())
    config["dtype"] = _DTYPE_NAMES[dtype]
    if "torch_dtype" in config:  # readers older than transformers v5 look here
        config["torch_dtype"] = _DTYPE_NAMES[dtype]
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return config


def _copy_side_files(model_dir: Path, out_dir: Path) -> None:
    for item in side_files(model_dir):
        if item.name != "config.json":  # written anew, with the export's dtype
            shutil.copy2(item, out_dir / item.name)


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
    lora = read_sidecar(step_dir).get("fingerprint", {}).get("model.lora")
    if merge and lora is None:
        raise ExportError(f"{step_dir}: --merge applies to LoRA checkpoints and this one holds every weight; "
                          "export it without --merge")
    write = _write_folder
    if lora is not None:
        from .lora import lora_writer

        write = lora_writer(lora, merge)
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
    log.info("exported %s to %s (%s, %d shards)", step_dir, out_dir, _DTYPE_NAMES[target], shard_count)
    return out_dir


def _write_folder(step_dir: Path, model_dir: Path, out: Path, target: torch.dtype, max_shard_bytes: int) -> int:
    config = _write_config(model_dir, out, target)
    prefix, entries = _model_entries(step_dir)
    if config.get("tie_word_embeddings", False):
        entries.pop("lm_head.weight", None)  # from_pretrained re-ties it to the input embeddings
    sizes = {n: _export_nbytes(m, target) for n, m in entries.items()}
    count = write_shards(out, sizes, lambda names: _load_group(step_dir, prefix, entries, names), target,
                         max_shard_bytes)
    _copy_side_files(model_dir, out)
    return count


def write_shards(out: Path, sizes: dict[str, int], load: Callable[[list[str]], dict[str, torch.Tensor]],
                 target: torch.dtype, max_shard_bytes: int) -> int:
    """Write the tensors named in ``sizes`` (bytes each, in ``target``) as sharded safetensors and their index
    into ``out``, which already holds config.json; ``load(names)`` gives one shard's tensors at a time."""
    shards = _plan_shards(sizes, max_shard_bytes)
    weight_map: dict[str, str] = {}
    for index, names in enumerate(shards, start=1):
        file_name = f"model-{index:05d}-of-{len(shards):05d}.safetensors"
        tensors = {n: _cast(t, target).contiguous() for n, t in load(names).items()}
        save_file(tensors, str(out / file_name), metadata={"format": "pt"})
        shutil.copymode(out / "config.json", out / file_name)  # safetensors creates 0600; share like the rest
        weight_map.update(dict.fromkeys(names, file_name))
        del tensors
        log.info("export: wrote %s (%d tensors)", file_name, len(names))
    index_doc = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index_doc, indent=2) + "\n")
    return len(shards)


def _export_nbytes(meta: TensorStorageMetadata, target: torch.dtype) -> int:
    dtype = target if meta.properties.dtype.is_floating_point else meta.properties.dtype
    return meta.size.numel() * dtype.itemsize


def _cast(tensor: torch.Tensor, target: torch.dtype) -> torch.Tensor:
    return tensor.to(target) if tensor.is_floating_point() else tensor


def export_from_path(path: Path, out_dir: Path, dtype: str = "bf16", model_dir: Path | None = None,
                     merge: bool = False) -> Path:
    """Export from a step folder, a checkpoint root, or a run folder (newest verified step).

    The original model folder defaults to the ``model_path`` recorded in the checkpoint's sidecar.
    Returns the step folder that was exported.
    """
    step_dir = select_checkpoint(Path(path))
    if model_dir is None:
        recorded = read_sidecar(step_dir).get("model_path")
        if not recorded:
            raise ExportError(f"{step_dir}: the checkpoint does not record the model folder; pass it with --model-dir")
        model_dir = Path(recorded)
    export_hf(step_dir, Path(model_dir), Path(out_dir), dtype, merge=merge)
    return step_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fsdpjob.jobs.export", description=export_from_path.__doc__)
    parser.add_argument("path", type=Path, help="step folder, checkpoint folder or run folder")
    parser.add_argument("--out", type=Path, required=True, help="output folder (must not exist or be empty)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--model-dir", type=Path, help="original model folder (default: recorded in the checkpoint)")
    parser.add_argument("--merge", action="store_true", help="LoRA: merge the adapters into the base model")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        step_dir = export_from_path(args.path, args.out, args.dtype, args.model_dir, merge=args.merge)
    except CheckpointError as exc:
        parser.exit(2, f"error: {exc}\n")
    print(f"exported {step_dir} -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
