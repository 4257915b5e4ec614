"""Export a LoRA checkpoint: a peft adapter folder (``PeftModel.from_pretrained`` loads it on the base model), or
the base model with the adapters merged in, as a Hugging Face folder like a full export.

Both read only the trainable entries of the DCP checkpoint (adapters and modules_to_save). The merge streams
the base model's safetensors one output shard at a time and adds each adapter's delta as peft computes it
(``get_delta_weight``: Linear, GPT-2's Conv1D, Embedding), so no full copy of the model is ever in memory.

A QLoRA checkpoint (model.quantize nf4) trained its adapters against the 4-bit base: its merge starts from each
quantized weight as training saw it (quantized and dequantized again, in model.dtype), so the merged model gives
the trained model's outputs; the adapter folder applies to the base as it is (load the base in 4 bits for that).
"""

from __future__ import annotations

import json
import logging
import math
import shutil
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from fsdpjob.orchestrator.core.jobspec.spec import LoraSpec
from fsdpjob.orchestrator.core.runfolder.sidecar import Sidecar
from fsdpjob.orchestrator.core.weightfiles import side_files

from ..model.lora import ADAPTER, attach_lora, base_fingerprint, base_name, is_adapter_key, lora_config, swap_parameter
from .hfdir import ExportError, copy_side_files, load_group, model_entries, write_config, write_shards

log = logging.getLogger("fsdpjob.export")

ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
_PEFT_PREFIX = "base_model.model."  # where PeftModelForCausalLM keeps the base model
_SAVED = f".modules_to_save.{ADAPTER}."


def lora_writer(lora: dict[str, Any], merge: bool, quantize: tuple[str, str] | None = None) -> Callable[..., int]:
    """The folder writer export_hf calls for a LoRA checkpoint (``lora``: the spec's model.lora, from its sidecar;
    ``quantize``: a QLoRA base's quantization and dtype, which the merge reproduces)."""
    try:
        import peft  # noqa: F401
    except ImportError:
        raise ExportError("this is a LoRA checkpoint: its export needs the peft package (pip install "
                          "'fsdpjob[lora]')") from None
    spec = LoraSpec.model_validate(lora)
    return partial(_write_merged, spec, quantize) if merge else partial(_write_adapter, spec)


def _trained(step_dir: Path, model_dir: Path) -> dict[str, torch.Tensor]:
    """The checkpoint's trained tensors (small: adapters and modules_to_save), by the injected model's names,
    once ``model_dir`` is known to hold the base they were trained on."""
    recorded = Sidecar.read(step_dir).run.base_contents
    if recorded is not None and base_fingerprint(model_dir) != recorded:
        raise ExportError(f"{model_dir}: not the base model these adapters were trained on (its weights differ "
                          f"from the ones {step_dir} recorded); pass the run's model folder")
    prefix, entries = model_entries(step_dir)
    return load_group(step_dir, prefix, entries, list(entries))


def _targets(trained: dict[str, torch.Tensor]) -> list[str]:
    """The modules that carry adapters, by their full names (``model.layers.0.self_attn.q_proj``)."""
    return sorted({key.split(".lora_", 1)[0] for key in trained if is_adapter_key(key)})


def _write_adapter(lora: Any, step_dir: Path, model_dir: Path, out: Path, target: torch.dtype, _: int) -> int:
    """adapter_config.json and adapter_model.safetensors as peft's save_pretrained writes them: keys under
    ``base_model.model.``, without the adapter name; modules_to_save under their module's own name."""
    trained = _trained(step_dir, model_dir)
    config = lora_config(lora, target_modules=_targets(trained))
    config.base_model_name_or_path = str(model_dir)
    config.save_pretrained(str(out))
    tensors = {}
    for key, tensor in trained.items():
        name = key.replace(_SAVED, ".") if _SAVED in key else key.replace(f".{ADAPTER}.", ".")
        tensors[_PEFT_PREFIX + name] = (tensor.to(target) if tensor.is_floating_point() else tensor).contiguous()
    save_file(tensors, str(out / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    shutil.copymode(out / ADAPTER_CONFIG, out / ADAPTER_WEIGHTS)
    for item in side_files(model_dir):  # the tokenizer, for added tokens trained through modules_to_save
        if item.name not in ("config.json", "generation_config.json"):
            shutil.copy2(item, out / item.name)
    log.info("export: wrote %s (%d tensors, %d adapted modules)", ADAPTER_WEIGHTS, len(tensors),
             len(config.target_modules))
    return 1


# ----------------------------------------------------------------------------------------------
# Merged: base weights + scaling x B @ A, module by module.


def _base_files(model_dir: Path) -> dict[str, Path]:
    """Each base tensor's safetensors file."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        return {k: model_dir / f for k, f in json.loads(index.read_text())["weight_map"].items()}
    single = model_dir / "model.safetensors"
    if not single.is_file():
        raise ExportError(f"{model_dir}: no safetensors weights to merge the adapters into")
    with safe_open(str(single), framework="pt") as f:
        return dict.fromkeys(f.keys(), single)


def _lora_layers(lora: Any, model_dir: Path, trained: dict[str, torch.Tensor]) -> tuple[dict[str, nn.Module], set[str]]:
    """The base model built on the meta device with the adapters injected, their trained values put in: each
    adapted module by the name of the base weight it changes; and the base names of the weights a QLoRA run
    holds in 4 bits (jobs/model/quantize.py)."""
    from peft.tuners.lora import LoraLayer
    from transformers import AutoConfig, AutoModelForCausalLM

    from ..model.build import find_decoder_layers
    from ..model.quantize import frozen_linears

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    attach_lora(model, lora, draw_initial=False)
    decoder = find_decoder_layers(model)
    prefix = next(n for n, m in model.named_modules() if m is decoder)
    frozen = {base_name(f"{prefix}.{name}.weight") for name in frozen_linears(decoder)}
    layers: dict[str, nn.Module] = {}
    for prefix, layer in model.named_modules():
        if isinstance(layer, LoraLayer):
            for name, _ in list(layer.named_parameters()):
                if not name.startswith("base_layer."):
                    swap_parameter(layer, name, nn.Parameter(trained[f"{prefix}.{name}"], requires_grad=False))
            layers[base_name(f"{prefix}.base_layer.weight")] = layer
    return layers, frozen


def _write_merged(lora: Any, quantize: tuple[str, str] | None, step_dir: Path, model_dir: Path, out: Path,
                  target: torch.dtype, max_shard_bytes: int) -> int:
    trained = _trained(step_dir, model_dir)
    layers, frozen = _lora_layers(lora, model_dir, trained)
    as_trained = _as_trained(quantize, frozen)
    saved = {base_name(k): t for k, t in trained.items() if _SAVED in k}  # trained in full: replace the base's
    files = _base_files(model_dir)
    unknown = sorted(set(layers) - set(files)) + sorted(set(saved) - set(files))
    if unknown:
        raise ExportError(
            f"{model_dir}: the base weights store {unknown[:3]} under other names (transformers converts them on "
            "load), so they cannot be merged one file at a time; export the adapter folder (without --merge) and "
            "merge it with peft's merge_and_unload"
        )
    config = write_config(model_dir, out, target)
    names = [n for n in files if not (config.get("tie_word_embeddings") and n == "lm_head.weight")]
    sizes = _sizes(files, names, target)

    @torch.no_grad()
    def load(group: list[str]) -> dict[str, torch.Tensor]:
        out_tensors = {}
        for name in group:
            if name in saved:
                out_tensors[name] = saved[name]
                continue
            with safe_open(str(files[name]), framework="pt") as f:
                tensor = as_trained(name, f.get_tensor(name))
            if name in layers:
                tensor = tensor.float() + layers[name].get_delta_weight(ADAPTER).float()  # cast on write
            out_tensors[name] = tensor
        return out_tensors

    count = write_shards(out, sizes, load, target, max_shard_bytes)
    copy_side_files(model_dir, out)
    log.info("export: merged the adapters of %d modules into %s", len(layers), out)
    return count


def _as_trained(quantize: tuple[str, str] | None, frozen: set[str]) -> Callable[[str, torch.Tensor], torch.Tensor]:
    """A base weight as the adapters were trained against it: a QLoRA run's 4-bit weights quantized from
    model.dtype and dequantized again (the same codes and scales as on the workers); the others as stored."""
    if quantize is None:
        return lambda name, tensor: tensor
    from ..model.quantize import BLOCK, scaler_block_size, to_nf4

    dtype = getattr(torch, quantize[1])

    def convert(name: str, tensor: torch.Tensor) -> torch.Tensor:
        if name not in frozen:
            return tensor
        return to_nf4(tensor.to(dtype), BLOCK, scaler_block_size(tensor.numel())).get_original_weight()

    return convert


def _sizes(files: dict[str, Path], names: list[str], target: torch.dtype) -> dict[str, int]:
    """Each tensor's bytes in the export: floating point in ``target``, the rest as stored (from the headers)."""
    sizes: dict[str, int] = {}
    for file in sorted(set(files.values())):
        with safe_open(str(file), framework="pt") as f:
            for name in set(f.keys()) & set(names):
                sl = f.get_slice(name)
                numel = math.prod(sl.get_shape())
                stored = _STORED_BYTES.get(sl.get_dtype(), 4)
                sizes[name] = numel * (target.itemsize if sl.get_dtype() in _FLOAT_DTYPES else stored)
    return {n: sizes[n] for n in names}


_FLOAT_DTYPES = {"F64", "F32", "F16", "BF16"}
_STORED_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}
