"""LoRA on the sharded model: peft adapters injected on the meta device before FSDP2, their first values drawn on
rank 0, the base weights mapped onto peft's module names, and the fingerprint that ties checkpoints to one base.

peft wraps each targeted module in place (``q_proj`` becomes a LoRA layer holding ``base_layer``, ``lora_A`` and
``lora_B``), so the Hugging Face model keeps its class, its decoder layers and its forward; FSDP2 then shards it
exactly as in full fine-tuning, frozen base and adapters alike, and only the adapters (and ``modules_to_save``)
get gradients and optimizer state. The PeftModel wrapper peft returns is not kept: training and checkpoints use
the injected model, and export writes peft's own folder layout (jobs/export/lora.py).
"""

from __future__ import annotations

import hashlib
import json
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fsdpjob.orchestrator.core.jobspec.families import lora_targets

ADAPTER = "default"  # peft's adapter name; checkpoint keys carry it (q_proj.lora_A.default.weight)
# The wrappers peft puts between a module and its weights; without them a key is the base model's own name.
_WRAPPER_PARTS = re.compile(rf"\.(base_layer|original_module|modules_to_save\.{ADAPTER})(?=\.)")
# The base fingerprint reads this many evenly spaced slices of each weight file (besides its size and header).
_SLICES, _SLICE_BYTES = 64, 16 * 1024


def base_name(key: str) -> str:
    """The base model's name for a state-dict key of the injected model (adapter keys come back unchanged)."""
    return _WRAPPER_PARTS.sub("", key)


def is_adapter_key(key: str) -> bool:
    return any(f".{part}.{ADAPTER}" in key for part in ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B"))


def lora_config(lora: Any, target_modules: Any = None, model_type: str = ""):
    """peft's LoraConfig for the spec's ``model.lora`` (``target_modules``: resolved names instead, for export;
    ``model_type``: the family that resolves target_modules auto, core/jobspec/families.py)."""
    from peft import LoraConfig

    return LoraConfig(
        r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
        target_modules=target_modules or lora_targets(model_type, lora.target_modules if isinstance(
            lora.target_modules, str) else list(lora.target_modules)),
        modules_to_save=list(lora.modules_to_save) or None, task_type="CAUSAL_LM",
    )


@dataclass
class Adapters:
    """What attach_lora did to the model: the keys it now has, mapped to the base names, and the adapters'
    first values (on the rank that reads the weights, empty elsewhere)."""

    base_names: dict[str, str]  # every state-dict key of the injected model -> the base model's key
    initial: dict[str, torch.Tensor] = field(default_factory=dict)

    def full_state_dict(self, base: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The injected model's full state dict from the base model's (rank 0): base weights under peft's names,
        the full copies of modules_to_save starting from the base weights, the adapters from their init."""
        if not base:
            return base  # ranks other than 0 receive everything by broadcast
        return {key: self.initial[key] if key in self.initial else base[name] for key, name in self.base_names.items()}


def attach_lora(model: nn.Module, lora: Any, *, draw_initial: bool) -> Adapters:
    """Inject the adapters of ``lora`` (the spec's model.lora) into ``model`` on the meta device, in place, and
    freeze everything else. ``draw_initial``: draw the adapters' first values (rank 0 only; see _initial_values)."""
    try:
        from peft import get_peft_model
    except ImportError:
        raise RuntimeError("model.lora needs the peft package on the workers; install it (pip install "
                           "'fsdpjob[lora]') or drop model.lora") from None
    try:
        with warnings.catch_warnings():  # peft asks transformers a deprecated question; nothing for the user
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*")
            warnings.filterwarnings("ignore", message="fan_in_fan_out is set to False")  # GPT-2's Conv1D: peft copes
            get_peft_model(model, lora_config(lora, model_type=model.config.model_type))
    except ValueError as exc:  # peft names the targets it did not find
        raise ValueError(
            f"model.lora.target_modules: {exc}. Name modules of {type(model).__name__} (e.g. q_proj, v_proj) "
            "or use all-linear"
        ) from None
    wrapped = {name for name, module in model.named_modules() if type(module).__name__ == "ModulesToSaveWrapper"}
    missing = [m for m in lora.modules_to_save if not any(w == m or w.endswith(f".{m}") for w in wrapped)]
    if missing:
        raise ValueError(
            f"model.lora.modules_to_save: {missing} are not modules of {type(model).__name__}; name its modules "
            "(e.g. embed_tokens, lm_head)"
        )
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError("model.lora: no parameter trains; check target_modules")
    base_names = {key: base_name(key) for key in model.state_dict()}
    return Adapters(base_names, _initial_values(model) if draw_initial else {})


def _initial_values(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapters' first values, as peft initializes them (A Kaiming-uniform, B zero), drawn on the CPU.

    The model is still on the meta device, so each LoRA layer's adapter parameters are swapped for CPU tensors
    while peft's own reset runs, then swapped back. One rank draws, from its RNG (seeded by train.seed) inside
    fork_rng, and the values reach every rank with the base weights: the start is the same on any world size,
    and no rank's random stream moves.
    """
    from peft.tuners.lora import LoraLayer

    values: dict[str, torch.Tensor] = {}
    with torch.random.fork_rng(devices=[]):
        for prefix, layer in model.named_modules():
            if not isinstance(layer, LoraLayer):
                continue
            own = [(n, p) for n, p in layer.named_parameters() if not n.startswith("base_layer.")]
            for name, param in own:
                empty = torch.empty(param.shape, dtype=param.dtype)
                swap_parameter(layer, name, nn.Parameter(empty, param.requires_grad))
            layer.reset_lora_parameters(ADAPTER, True)
            for name, param in own:
                values[f"{prefix}.{name}"] = swap_parameter(layer, name, param).detach()
    return values


def swap_parameter(module: nn.Module, dotted: str, param: nn.Parameter) -> nn.Parameter:
    """Put ``param`` at ``dotted`` under ``module``; return what was there."""
    owner_name, _, leaf = dotted.rpartition(".")
    owner = module.get_submodule(owner_name) if owner_name else module
    old = owner._parameters[leaf]
    owner._parameters[leaf] = param
    return old


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    """What the optimizer steps: every parameter in full fine-tuning, the adapters (and modules_to_save) with LoRA."""
    return [p for p in model.parameters() if p.requires_grad]


# ----------------------------------------------------------------------------------------------
# The base model a LoRA checkpoint belongs to.


def base_fingerprint(model_dir: str | Path) -> str:
    """A content hash of the base model folder: config.json, and for each safetensors file its name, size, header
    and evenly spaced slices of its data (1 MiB per file, not the whole file: seconds for a 70B model).

    Another model, or another fine-tune of the same one, differs in nearly every tensor and so in the slices;
    an edit to a single small tensor can escape it.
    """
    folder = Path(model_dir)
    digest = hashlib.sha256()
    digest.update((folder / "config.json").read_bytes())
    for file in sorted(folder.glob("*.safetensors")):
        size = file.stat().st_size
        digest.update(f"{file.name}\0{size}\0".encode())
        with open(file, "rb") as f:
            header_len = int.from_bytes(f.read(8), "little")
            digest.update(f.read(min(header_len, size)))
            start = 8 + header_len
            span = max(size - start - _SLICE_BYTES, 0)
            for i in range(_SLICES):
                f.seek(start + span * i // max(_SLICES - 1, 1))
                digest.update(f.read(_SLICE_BYTES))
    return "sha256:" + digest.hexdigest()[:32]


def checkpoint_fingerprint(spec: Any) -> dict[str, Any]:
    """What a checkpoint must match to be resumed: the spec's model fingerprint and, with LoRA, the base model's
    contents (the checkpoint holds only the adapters, which mean nothing on another base)."""
    fingerprint = spec.model_fingerprint()
    if spec.model.lora is not None:
        fingerprint["model.path contents"] = base_fingerprint(spec.model.path)
        # target_modules auto as the family resolves it: all-linear on a dense model, as checkpoints written before
        # auto recorded it, and the modules export must adapt again (it reads model.lora back from here)
        model_type = json.loads((Path(spec.model.path) / "config.json").read_text()).get("model_type", "")
        lora = fingerprint["model.lora"]
        fingerprint["model.lora"] = {**lora, "target_modules": lora_targets(model_type, lora["target_modules"])}
    return fingerprint
