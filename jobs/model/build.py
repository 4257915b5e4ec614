"""Build a Hugging Face causal LM sharded from the start: meta init, FSDP2, each rank reading its own shards."""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.device_mesh import DeviceMesh

from fsdpjob.orchestrator.core.jobspec.families import attention_for, windowed
from fsdpjob.orchestrator.core.weightfiles import INDEX_FILE, SINGLE_FILE, weight_files

from ..dist import DistEnv
from . import varlen
from .checkpointing import Checkpointing
from .lora import attach_lora
from .parallelize import apply_fsdp
from .quantize import load_quantized, quantize_on_meta
from .scorehead import classifier_on_meta, load_classifier
from .weightload import load_sharded

log = logging.getLogger("fsdpjob.jobs.model")

_MIXED_PRECISION = {"bf16": torch.bfloat16, "fp32": torch.float32}


def _no_split_classes(model: nn.Module) -> set[str]:
    """The class names of the model's decoder blocks, as it declares them for FSDP (what accelerate wraps)."""
    names = getattr(model, "_no_split_modules", None) or []
    inner = getattr(model, "model", None)
    names = [*names, *(getattr(inner, "_no_split_modules", None) or [])]
    return {str(n) for n in names}


def find_decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The repeated transformer blocks FSDP wraps one by one (and activation checkpointing recomputes).

    ``model.model.layers`` where it exists (most HF decoder-only models); else the ModuleList holding the
    blocks the model names in ``_no_split_modules`` (gpt2 and falcon ``transformer.h``, gpt_neox
    ``gpt_neox.layers``); else the largest ModuleList whose children all share one class.
    """
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if isinstance(layers, nn.ModuleList) and len(layers) > 0:
        return layers
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) > 0]
    blocks = _no_split_classes(model)
    declared = [m for m in lists if all(type(c).__name__ in blocks for c in m)]
    if declared:
        return max(declared, key=len)
    candidates = [m for m in lists if len({type(c) for c in m}) == 1]
    if not candidates:
        raise ValueError(
            f"cannot find the decoder blocks of {type(model).__name__}: it has no model.layers, no ModuleList of the "
            f"blocks its _no_split_modules names ({sorted(blocks) or 'none declared'}) and no ModuleList of identical "
            "blocks; fsdpjob trains decoder-only transformer models: use a supported family (docs/reference/"
            "families.md)"
        )
    return max(candidates, key=len)


def _check_attn_implementation(attn_implementation: str) -> None:
    """flash-attn importable, not only present: a wheel built for another torch or CUDA is found by find_spec and
    then fails at its first import (an undefined symbol), in the first forward (review item 17)."""
    if attn_implementation != "flash_attention_2":
        return
    if importlib.util.find_spec("flash_attn") is None:
        raise RuntimeError(
            "model.attn_implementation is flash_attention_2 but the flash-attn package is not installed on the "
            "worker; install it (pip install flash-attn, CUDA only) or use auto"
        )
    try:
        importlib.import_module("flash_attn")
    except Exception as exc:  # ImportError, OSError (a missing .so), or whatever its own import raises
        raise RuntimeError(
            f"model.attn_implementation is flash_attention_2 but flash-attn does not import on the worker "
            f"({type(exc).__name__}: {str(exc)[:300]}); reinstall it for this torch and CUDA, or use auto"
        ) from exc


def resolve_attention(config, requested: str, *, device: torch.device, packed: bool, mixed_precision: str) -> str:
    """The implementation name the model is built with (core/families.attention_for's rule, then this torch):
    ``varlen`` becomes fsdpjob's registered varlen attention; auto's varlen falls back to sdpa on a torch
    without the CUDA varlen kernel (older than 2.10), an explicit varlen on a GPU refuses."""
    on_gpu = device.type == "cuda"
    chosen = attention_for(config.model_type, requested, on_gpu=on_gpu, packed=packed,
                           half=mixed_precision == "bf16", windowed=windowed(config.to_dict()))
    if chosen != "varlen":
        return chosen
    if on_gpu and not varlen.cuda_kernel_available():
        if requested == "auto":
            log.warning("torch %s has no varlen flash attention (torch >= 2.10): packed batches use sdpa with a "
                        "dense mask", torch.__version__)
            return attention_for(config.model_type, "sdpa")
        raise RuntimeError(f"model.attn_implementation varlen needs torch >= 2.10 on CUDA (this is "
                           f"{torch.__version__}); use auto")
    varlen.register()
    return varlen.NAME


def _weight_files(path: Path) -> list[Path]:
    files = weight_files(path)
    if files is not None:
        return files
    raise FileNotFoundError(
        f"{path}: no {SINGLE_FILE} or {INDEX_FILE}; fsdpjob reads safetensors weights only "
        "(re-save the model with save_pretrained to convert)"
    )


def _tie_groups(model: nn.Module) -> list[list[str]]:
    """Names that share one parameter (tied embeddings): a checkpoint stores only one of each group."""
    by_param: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        by_param.setdefault(id(param), []).append(name)
    return [names for names in by_param.values() if len(names) > 1]


def read_full_state_dict(path: Path, expected: set[str], tie_groups: list[list[str]]) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors checkpoint, keyed like ``expected``; tied names filled from their twin.

    Tensors keep the file's dtype: the copy into each rank's shard casts, so a bf16 file trained in fp32
    broadcasts half the bytes and rank 0 never holds an fp32 copy of the full model.
    """
    from safetensors import safe_open

    full: dict[str, torch.Tensor] = {}
    for file in _weight_files(path):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                full[key] = f.get_tensor(key)
    for group in tie_groups:
        present = [n for n in group if n in full]
        for name in group:
            if present and name not in full:
                full[name] = full[present[0]]
    missing, unexpected = sorted(expected - full.keys()), sorted(full.keys() - expected)
    if missing or unexpected:
        converted = _read_through_transformers(path, expected)  # renamed or fused keys (mixtral, gpt_neox)
        if converted is not None:
            return converted
        raise ValueError(
            f"{path}: the weights do not match the model built from config.json: "
            f"missing {missing[:5]}{' ...' if len(missing) > 5 else ''}, "
            f"unexpected {unexpected[:5]}{' ...' if len(unexpected) > 5 else ''}"
        )
    return full


def _read_through_transformers(path: Path, expected: set[str]) -> dict[str, torch.Tensor] | None:
    """The weights as transformers' own loader names them, for checkpoints whose stored keys it converts on
    load (transformers 5: mixtral's per-expert w1/w2/w3 fused into experts.gate_up_proj, gpt_neox's embed_out
    as lm_head ...); None unless it fills every parameter from the file. Rank 0 holds one full copy, as above."""
    from transformers import AutoModelForCausalLM

    try:
        model, info = AutoModelForCausalLM.from_pretrained(path, dtype="auto", output_loading_info=True)
    except Exception:  # the caller names the mismatch instead
        return None
    if info.get("missing_keys") or info.get("mismatched_keys") or info.get("error_msgs"):
        return None
    full = dict(model.state_dict())
    return full if full.keys() == expected else None


def _read_on_rank0(env: DistEnv, path: Path, expected: set[str], tie_groups: list[list[str]]) -> dict[str, Any]:
    """Rank 0 reads; its failure is sent to every rank so that all fail together instead of hanging in a broadcast."""
    full: dict[str, Any] = {}
    failure: Exception | None = None
    if env.is_main:
        try:
            full = read_full_state_dict(path, expected, tie_groups)
        except Exception as e:  # relayed to the other ranks, re-raised below
            failure = e
    message = [f"{type(failure).__name__}: {failure}" if failure else None]
    dist.broadcast_object_list(message, src=0)
    if message[0] is not None:
        raise RuntimeError(f"rank 0 could not read the model weights: {message[0]}") from failure
    return full


def _causal_keys(config, attn_implementation: str) -> tuple[set[str], list[list[str]]]:
    """The state-dict keys and tie groups of the causal LM a model folder holds (on meta: nothing allocated)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        causal = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)
    return set(causal.state_dict()), _tie_groups(causal)


def _on_meta(config, head: str, *, attn_implementation: str, dtype: torch.dtype, pad_token_id: int | None,
             lora: Any) -> nn.Module:
    """The causal LM (``head="lm"``) or the reward model (``"score"``) of ``config`` on the meta device."""
    from transformers import AutoModelForCausalLM

    if head == "score":
        if lora is not None:  # the spec refuses it (core/jobspec/methods.py); a caller's mistake otherwise
            raise ValueError("a reward model (head score) is trained in full: LoRA is not supported with it")
        return classifier_on_meta(config, attn_implementation=attn_implementation, dtype=dtype,
                                  pad_token_id=pad_token_id)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation, dtype=dtype)


def _non_persistent_buffers(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [(n, b) for n, b in module._buffers.items() if b is not None and n in module._non_persistent_buffers_set]


def _fill_sentinel(buf: torch.Tensor) -> None:
    buf.fill_(torch.nan if buf.is_floating_point() else torch.iinfo(buf.dtype).min)


def _is_sentinel(buf: torch.Tensor) -> bool:
    return bool(buf.isnan().any() if buf.is_floating_point() else (buf == torch.iinfo(buf.dtype).min).any())


@torch.no_grad()
def recompute_non_persistent_buffers(model: nn.Module) -> None:
    """Refill buffers that are not in the checkpoint (rotary ``inv_freq`` ...): ``to_empty`` left garbage there.

    Uses the model's own HF initializer on their modules, as ``from_pretrained`` does; a buffer it leaves
    unfilled is an error rather than silent garbage.
    """
    owners = [m for m in model.modules() if _non_persistent_buffers(m)]
    for module in owners:
        for _, buf in _non_persistent_buffers(module):
            _fill_sentinel(buf)
        # HF's init functions skip flagged tensors: the owner's own parameters are loaded right after.
        for param in module.parameters(recurse=False):
            param._is_hf_initialized = True
        model._init_weights(module)  # type: ignore[operator]
    for module in owners:
        for name, buf in _non_persistent_buffers(module):
            if _is_sentinel(buf):
                raise RuntimeError(
                    f"{type(module).__name__}.{name}: the model's initializer does not recompute this non-persistent "
                    "buffer, so meta-device loading cannot restore it"
                )


def _materialize(model: nn.Module, device: torch.device, cpu_offload: bool) -> None:
    """Allocate the (sharded) meta tensors, uninitialized, and recompute the buffers no checkpoint holds."""
    # Offloaded shards must stay in host memory; buffers are not FSDP-managed and go to the compute device.
    model.to_empty(device="cpu" if cpu_offload else device)
    if cpu_offload:
        for module in model.modules():
            for name, buf in module._buffers.items():
                if buf is not None:
                    module._buffers[name] = buf.to(device)
    recompute_non_persistent_buffers(model)


def load_model(
    path: str | Path,
    *,
    env: DistEnv,
    mesh: DeviceMesh,
    dtype: torch.dtype,
    attn_implementation: str,
    mixed_precision: str,
    reshard_after_forward: bool,
    activation_checkpointing: Checkpointing,
    cpu_offload: bool,
    reduce_dtype: torch.dtype = torch.float32,
    lora: Any = None,
    compile_layers: bool | str = False,
    read_weights: bool = True,
    packed: bool = False,
    head: str = "lm",
    pad_token_id: int | None = None,
    separate_root: bool = False,
    quantize: str | None = None,
) -> nn.Module:
    """The model at ``path``, FSDP2-sharded over ``mesh``, weights in ``dtype``; with ``read_weights`` False
    uninitialized (the caller loads a checkpoint that holds every weight).

    No rank builds the full model: it is created on the meta device, sharded, then materialized shard by
    shard; each rank reads its own shards of safetensors weights, or (stored names that need transformers'
    conversion, LoRA, FSDPJOB_WEIGHT_LOAD=rank0) rank 0 reads them and each tensor is broadcast and sliced.
    ``head="score"``: the reward model instead, the backbone with a scalar head whose rows are scored at their
    last token that is not ``pad_token_id`` (jobs/model/scorehead.py). ``activation_checkpointing``: what the
    decoder blocks recompute (jobs/model/checkpointing.py); ``separate_root``: the embedding and the output head
    as FSDP units of their own (parallelize.root_units). ``quantize="nf4"`` (with ``lora``): the frozen linear
    weights of the decoder blocks in 4 bits (jobs/model/quantize.py), each rank quantizing its own shards.
    """
    from transformers import AutoConfig

    if mixed_precision not in _MIXED_PRECISION:
        raise ValueError(f"fsdp.mixed_precision {mixed_precision!r} is not one of {sorted(_MIXED_PRECISION)}")
    _check_attn_implementation(attn_implementation)
    path = Path(path)
    config = AutoConfig.from_pretrained(path)
    attn_implementation = resolve_attention(config, attn_implementation, device=env.device, packed=packed,
                                            mixed_precision=mixed_precision)
    model = _on_meta(config, head, attn_implementation=attn_implementation, dtype=dtype, pad_token_id=pad_token_id,
                     lora=lora)
    expected, tie_groups = set(model.state_dict().keys()), _tie_groups(model)
    # LoRA (spec model.lora): adapters injected before sharding, so FSDP2 wraps base and adapters together.
    adapters = attach_lora(model, lora, draw_initial=env.is_main) if lora is not None else None
    layers = find_decoder_layers(model)
    # QLoRA (spec model.quantize): the frozen base in 4 bits, before sharding, so FSDP2 shards the 4-bit codes.
    quantized, unsharded = _quantized(model, layers, quantize, mesh.size())
    apply_fsdp(
        model,
        mesh=mesh,
        layers=layers,
        param_dtype=_MIXED_PRECISION[mixed_precision],
        reduce_dtype=reduce_dtype,  # fsdp.reduce_dtype: the gradients' reduce-scatter
        reshard_after_forward=reshard_after_forward,
        activation_checkpointing=activation_checkpointing,
        cpu_offload=cpu_offload,
        compile_layers=compile_layers,
        separate_root=separate_root,
        ignored_params=unsharded,
    )
    _materialize(model, env.device, cpu_offload)
    if not read_weights:
        log.info("built %s (%s) on rank %d; its weights come from the checkpoint", path, type(model).__name__, env.rank)
        return model
    if head == "score":
        causal_keys, causal_ties = _causal_keys(config, attn_implementation)
        load_classifier(model, path, env, causal_keys, lambda: _read_on_rank0(env, path, causal_keys, causal_ties))
        return model
    # Safetensors: each rank reads only its own shards (jobs/model/weightload.py); otherwise rank 0 reads and
    # broadcasts.
    if adapters is None and load_sharded(model, path, expected, tie_groups):
        log.info("loaded %s (%s) into FSDP2 shards on rank %d", path, type(model).__name__, env.rank)
        return model
    _load_from_rank0(model, path, env, expected, tie_groups, adapters, quantized, dtype)
    log.info("loaded %s (%s) into FSDP2 shards on rank %d", path, type(model).__name__, env.rank)
    return model


def _quantized(model: nn.Module, layers: nn.ModuleList, quantize: str | None,
               world: int) -> tuple[dict[str, str], set[nn.Parameter] | None]:
    """The 4-bit weights (quantize.quantize_on_meta's keys) and those FSDP2 must leave alone: all of them on one rank,
    where torch's FSDP2 (2.13) copies a subclass's first all-gather input only (NF4 has three) and there is nothing
    to shard anyway."""
    if quantize is None:
        return {}, None
    quantized = quantize_on_meta(model, layers, world)
    return quantized, {p for n, p in model.named_parameters() if n in quantized} if world == 1 else None


def _load_from_rank0(model: nn.Module, path: Path, env: DistEnv, expected: set[str], tie_groups: list[list[str]],
                     adapters: Any, quantized: dict[str, str], dtype: torch.dtype) -> None:
    """Rank 0 reads the weights and each tensor is broadcast into the shards; with LoRA the adapters' first values
    join them, and the 4-bit weights (model.quantize) are quantized from the files on every rank instead."""
    full = _read_on_rank0(env, path, expected, tie_groups)
    if adapters is not None:
        full = adapters.full_state_dict(full)
    if quantized:
        load_quantized(model, path, quantized, dtype)
        full = {k: v for k, v in full.items() if k not in quantized}
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True,
                                                               strict=not quantized))
