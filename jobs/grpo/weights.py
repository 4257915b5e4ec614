"""The generation server's policy weights: full state dicts and LoRA adapters loaded into the live model.

A full load (a ``.safetensors`` file, or a folder of them, by Hugging Face parameter names) replaces every weight
and becomes the new base. A LoRA load (a peft adapter folder: ``adapter_config.json`` + ``adapter_model.safetensors``)
is merged into the base: the weights an earlier adapter changed are first put back from the copies kept when it
was merged, so adapters replace each other and never stack, and loading adapter A again gives bitwise the model A
gave before. Everything is checked (names, shapes, supported options) before any weight changes, so a refused
load leaves the served model as it was.

The merge follows peft's arithmetic (``scaling * B @ A``, transposed for embeddings and fan_in_fan_out layers),
done in float32 and cast to the weight's dtype.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from fsdpjob.orchestrator.core.genserver.client import ADAPTER_CONFIG, ADAPTER_WEIGHTS

_PEFT_PREFIX = "base_model.model."  # where peft's save_pretrained puts the base model's names
_LORA_PARTS = {".lora_A.weight": ("A", "linear"), ".lora_B.weight": ("B", "linear"),
               ".lora_embedding_A": ("A", "embedding"), ".lora_embedding_B": ("B", "embedding")}


class WeightError(ValueError):
    """A load the server refuses (bad path, unknown names, wrong shapes, unsupported adapter): one line."""


@dataclass(frozen=True)
class _Delta:
    weight: str  # the base parameter it changes, e.g. model.layers.0.self_attn.q_proj.weight
    a: torch.Tensor
    b: torch.Tensor
    transpose: bool  # embeddings, and Conv1D-style (fan_in_fan_out) layers


class PolicyWeights:
    """Loads published weights into ``model`` in place; remembers what the current adapter changed."""

    def __init__(self, model: nn.Module):
        self.model = model
        self._originals: dict[str, torch.Tensor] = {}  # base values (CPU) of the weights the adapter changed

    def load(self, path: str | Path) -> str:
        """Load a full state dict or a LoRA adapter from ``path``; returns "full" or "lora"."""
        path = Path(path)
        if not path.exists():
            raise WeightError(f"{path}: no such file or folder")
        if path.is_dir() and (path / ADAPTER_CONFIG).is_file():
            self._load_lora(path)
            return "lora"
        self._load_full(_full_files(path))
        return "full"

    # -- full state dicts -------------------------------------------------------------------------------

    def _load_full(self, files: list[Path]) -> None:
        tensors = _read(files)
        targets = _targets(self.model)
        _check_known(tensors, targets, files[0].parent if len(files) > 1 else files[0])
        missing = [names[0] for names in _tied_groups(self.model) if not any(n in tensors for n in names)]
        if missing:
            raise WeightError(f"{files[0]}: {len(missing)} weights missing, e.g. {missing[:3]} (a full load "
                              "needs every weight; publish LoRA adapters as an adapter folder)")
        with torch.no_grad():
            for name, tensor in tensors.items():
                targets[name].copy_(tensor)
        self._originals = {}  # the full weights are the new base

    # -- LoRA adapters ----------------------------------------------------------------------------------

    def _load_lora(self, folder: Path) -> None:
        scaling = _scaling(folder)
        weights = folder / ADAPTER_WEIGHTS
        if not weights.is_file():
            raise WeightError(f"{folder}: no {ADAPTER_WEIGHTS} beside {ADAPTER_CONFIG}")
        tensors = {_strip(k, folder): t for k, t in _read([weights]).items()}
        fan_in_fan_out = bool(json.loads((folder / ADAPTER_CONFIG).read_text()).get("fan_in_fan_out"))
        deltas, replaced = _plan(tensors, fan_in_fan_out, folder)
        targets = _targets(self.model)
        _check_known({d.weight: d for d in deltas} | replaced, targets, folder)
        for d in deltas:
            shape = (d.a.shape[1], d.b.shape[0]) if d.transpose else (d.b.shape[0], d.a.shape[1])
            if tuple(targets[d.weight].shape) != shape or d.a.shape[0] != d.b.shape[1]:
                raise WeightError(f"{folder}: the adapter of {d.weight} (A {tuple(d.a.shape)}, B {tuple(d.b.shape)}) "
                                  f"does not fit its weight {tuple(targets[d.weight].shape)}")
        with torch.no_grad():
            for name, original in self._originals.items():  # undo the previous adapter first: never stack
                targets[name].copy_(original)
            touched = [d.weight for d in deltas] + list(replaced)
            self._originals = {name: targets[name].detach().to("cpu", copy=True) for name in touched}
            for name, tensor in replaced.items():  # first: an adapted embedding's saved base weight is one of them
                targets[name].copy_(tensor)
            for d in deltas:
                target = targets[d.weight]
                delta = d.b.to(target.device, torch.float32) @ d.a.to(target.device, torch.float32)
                delta = delta.T if d.transpose else delta
                target.copy_(target.float() + scaling * delta)


def _full_files(path: Path) -> list[Path]:
    if path.is_file():
        if path.suffix != ".safetensors":
            raise WeightError(f"{path}: not a .safetensors file")
        return [path]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise WeightError(f"{path}: neither {ADAPTER_CONFIG} (a LoRA adapter) nor .safetensors files (full weights)")
    return files


def _read(files: list[Path]) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            tensors.update(load_file(str(file), device="cpu"))
        except (SafetensorError, OSError) as err:
            raise WeightError(f"{file}: unreadable safetensors ({str(err).splitlines()[0]})") from None
    return tensors


def _targets(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every name a state dict may carry (tied aliases included) -> the live tensor it sets."""
    targets = dict(model.named_parameters(remove_duplicate=False))
    persistent = set(model.state_dict())
    targets.update((n, b) for n, b in model.named_buffers(remove_duplicate=False) if n in persistent)
    return targets


def _tied_groups(model: nn.Module) -> list[list[str]]:
    """The parameters by identity: tied weights (embeddings and lm_head) are one entry under several names."""
    groups: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), []).append(name)
    return list(groups.values())


def _check_known(tensors: dict, targets: dict[str, torch.Tensor], where: Path) -> None:
    unknown = sorted(set(tensors) - set(targets))
    if unknown:
        raise WeightError(f"{where}: {len(unknown)} names the model does not have, e.g. {unknown[:3]}")
    wrong = [n for n, t in tensors.items() if isinstance(t, torch.Tensor) and t.shape != targets[n].shape]
    if wrong:
        n = wrong[0]
        raise WeightError(f"{where}: {len(wrong)} tensors of the wrong shape, e.g. {n} {tuple(tensors[n].shape)} "
                          f"for the model's {tuple(targets[n].shape)}")


def _scaling(folder: Path) -> float:
    try:
        config = json.loads((folder / ADAPTER_CONFIG).read_text())
    except (OSError, ValueError) as err:
        raise WeightError(f"{folder / ADAPTER_CONFIG}: unreadable ({err})") from None
    unsupported = [k for k in ("use_dora", "rank_pattern", "alpha_pattern", "lora_bias") if config.get(k)]
    if config.get("peft_type", "LORA") != "LORA" or unsupported:
        raise WeightError(f"{folder}: adapter options the server does not merge: "
                          f"{unsupported or [config.get('peft_type')]} (plain LoRA only)")
    r, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(r, int) or r <= 0 or not isinstance(alpha, int | float):
        raise WeightError(f"{folder / ADAPTER_CONFIG}: needs an integer r > 0 and a lora_alpha")
    return alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r


def _strip(key: str, folder: Path) -> str:
    if not key.startswith(_PEFT_PREFIX):
        raise WeightError(f"{folder / ADAPTER_WEIGHTS}: key {key!r} is not under {_PEFT_PREFIX!r} (peft's layout)")
    return key[len(_PEFT_PREFIX):]


def _plan(tensors: dict[str, torch.Tensor], fan_in_fan_out: bool,
          folder: Path) -> tuple[list[_Delta], dict[str, torch.Tensor]]:
    """The adapter's A/B pairs by the weight they change, and the tensors it replaces whole (modules_to_save)."""
    halves: dict[str, dict[str, torch.Tensor]] = {}
    kinds: dict[str, str] = {}
    replaced: dict[str, torch.Tensor] = {}
    for key, tensor in tensors.items():
        part = next((p for p in _LORA_PARTS if key.endswith(p)), None)
        if part is None:  # modules_to_save, or the embedding weights peft saves beside an embedding's adapter
            replaced[key.replace(".base_layer.", ".")] = tensor
            continue
        module = key[: -len(part)]
        half, kind = _LORA_PARTS[part]
        halves.setdefault(module, {})[half] = tensor
        kinds[module] = kind
    incomplete = sorted(m for m, h in halves.items() if set(h) != {"A", "B"})
    if incomplete:
        raise WeightError(f"{folder}: lora_A without lora_B (or the reverse) for {incomplete[:3]}")
    deltas = [_Delta(f"{m}.weight", h["A"], h["B"], kinds[m] == "embedding" or fan_in_fan_out)
              for m, h in sorted(halves.items())]
    return deltas, replaced
