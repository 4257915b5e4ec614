"""The Hugging Face folder both export writers fill: the model weights' entries of a DCP step folder, a group of
them loaded at a time, config.json with the export's dtype, the side files, and the sharded safetensors."""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from fsdpjob.orchestrator.core.runfolder.ckptlayout import SIDECAR
from fsdpjob.orchestrator.core.runfolder.sidecar import Sidecar
from fsdpjob.orchestrator.core.weightfiles import side_files

from ..checkpoint.manager import CheckpointError, single_process_dcp

log = logging.getLogger("fsdpjob.export")

DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp32": torch.float32, "float32": torch.float32}
DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float32: "float32"}


class ExportError(CheckpointError):
    """The export cannot be done as asked (missing model folder, output folder in the way, ...)."""


def _model_prefix(step_dir: Path, fqns: list[str]) -> str:
    """'<key>.model.' where the ModelOptimState sits: from the sidecar, else the one key with .model and .optim."""
    key = Sidecar.read(step_dir).model_key
    if key is None:
        tops = {f.split(".", 2)[0] for f in fqns if f.count(".") >= 2 and f.split(".", 2)[1] == "model"}
        with_optim = sorted(t for t in tops if any(f.startswith(f"{t}.optim.") for f in fqns))
        key = with_optim[0] if len(with_optim) == 1 else None
    if key is None:
        raise ExportError(f"{step_dir}: cannot tell which entry holds the model weights (no model_key in {SIDECAR})")
    return f"{key}.model."


def model_entries(step_dir: Path) -> tuple[str, dict[str, TensorStorageMetadata]]:
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


def load_group(
    step_dir: Path, prefix: str, entries: dict[str, TensorStorageMetadata], names: list[str]
) -> dict[str, torch.Tensor]:
    """The full tensors of ``names`` (Hugging Face names) from the step folder."""
    # Empty full-size tensors for just these keys; DCP reads the matching chunks from every rank's file.
    wanted = {prefix + n: torch.empty(entries[n].size, dtype=entries[n].properties.dtype) for n in names}
    with single_process_dcp():
        dcp.load(wanted, storage_reader=FileSystemReader(str(step_dir)), no_dist=True)
    return {n: wanted[prefix + n] for n in names}


def write_config(model_dir: Path, out_dir: Path, dtype: torch.dtype, classifier: bool = False) -> dict[str, Any]:
    """The model folder's config.json into ``out_dir`` with the export's dtype; returns the config.
    ``classifier``: the weights are a reward model's (train.method reward), a sequence classifier's config."""
    config = json.loads((model_dir / "config.json").read_text())
    if classifier:
        config.update(_classifier_fields(config, model_dir))
    config["dtype"] = DTYPE_NAMES[dtype]
    if "torch_dtype" in config:  # readers older than transformers v5 look here
        config["torch_dtype"] = DTYPE_NAMES[dtype]
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return config


def _classifier_fields(config: dict[str, Any], model_dir: Path) -> dict[str, Any]:
    """What makes AutoModelForSequenceClassification load the reward model: one label, its class, and the pad id
    training scored the rows by (their last token that is not it: jobs/model/scorehead.py)."""
    from transformers import AutoTokenizer
    from transformers.models.auto.modeling_auto import MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES

    from ..data.pairtable import pad_id_of

    fields: dict[str, Any] = {"num_labels": 1, "id2label": {"0": "LABEL_0"}, "label2id": {"LABEL_0": 0}}
    name = MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES.get(config.get("model_type"))
    if name:
        fields["architectures"] = [name]
    fields["pad_token_id"] = pad_id_of(AutoTokenizer.from_pretrained(model_dir))  # as jobs/parts.py gives training
    return fields


def copy_side_files(model_dir: Path, out_dir: Path) -> None:
    """The tokenizer, generation config, chat template ... of the model folder, next to the weights."""
    for item in side_files(model_dir):
        if item.name != "config.json":  # written anew, with the export's dtype
            shutil.copy2(item, out_dir / item.name)


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


def _cast(tensor: torch.Tensor, target: torch.dtype) -> torch.Tensor:
    return tensor.to(target) if tensor.is_floating_point() else tensor
