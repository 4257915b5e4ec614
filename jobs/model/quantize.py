"""QLoRA's frozen base in 4 bits (spec ``model.quantize: nf4``): torchao's NF4 tensor in place of each frozen linear
weight of the decoder blocks, made on the meta device before FSDP2 shards it, filled per rank from the weight files.

torchao's NF4Tensor (the QLoRA paper's NormalFloat4 with double-quantized block scales) implements FSDP2's
all-gather extension (``fsdp_pre_all_gather`` / ``fsdp_post_all_gather``): a shard is its 4-bit codes and its
block scales, the all-gather moves those, and the gathered weight is dequantized in the linear's forward and
backward only (torchtune runs QLoRA under FSDP2 this way). Only the frozen linear weights of the decoder blocks
are quantized (the LoRA targets' base layers and the other frozen linears); embeddings, norms, the output head,
the adapters and fused 3-D expert tensors (transformers' MoE experts, which NF4 cannot shard) keep model.dtype.

Quantization happens on the full tensor, then the codes are cut into the rank's rows (as torchtune does): the
double quantization keeps one mean of the scales per tensor, which a shard quantized alone would get wrong. So the
4-bit base is the same on every world size, and every rank reads each full weight once, one tensor at a time.
On one rank the 4-bit weights stay plain parameters outside FSDP2 (jobs/model/build.py): torch 2.13's single-rank
path copies only the first of the three tensors NF4 gathers.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from fsdpjob.orchestrator.core.savers import NF4_BLOCK, nf4_scaler_block, nf4_shard_problem

from .lora import base_name

log = logging.getLogger("fsdpjob.jobs.model")

CHECKPOINT_WRAPPER = "_checkpoint_wrapped_module."
_NF4_TENSORS = ("quantized_scalers", "quantization_factor", "quantized_data", "scaler_mean", "nf4")
# The layout rules the plan checks too (core/savers.py): blocks of 64, scale groups by the weight's shape.
BLOCK, scaler_block_size = NF4_BLOCK, nf4_scaler_block


def to_nf4(tensor: torch.Tensor, block_size: int, scaler_block: int):
    """torchao's NF4 tensor of ``tensor`` (on the meta device too: the shapes only)."""
    try:
        from torchao.quantization import to_nf4 as torchao_to_nf4
    except ImportError:
        raise RuntimeError("model.quantize nf4 needs the torchao package on the workers; install it (pip install "
                           "'fsdpjob[quantize]') or drop model.quantize") from None
    return torchao_to_nf4(tensor, block_size, scaler_block)


def frozen_linears(layers: nn.ModuleList) -> dict[str, nn.Linear]:
    """The decoder blocks' linear layers whose weight does not train, by their path under ``layers``."""
    return {name: module for name, module in layers.named_modules()
            if isinstance(module, nn.Linear) and not module.weight.requires_grad}


def quantize_on_meta(model: nn.Module, layers: nn.ModuleList, world_size: int) -> dict[str, str]:
    """Swap every frozen linear weight of ``layers`` for an NF4 tensor, on the meta device, in place.

    Returns each quantized weight's state-dict key mapped to its name in the weight files. Raises ValueError
    (naming the first module) where a weight cannot be cut into ``world_size`` shards of whole scale groups:
    FSDP2 shards NF4 codes by whole rows and cannot pad them.
    """
    layer_prefix = next(n for n, m in model.named_modules() if m is layers)
    keys: dict[str, str] = {}
    for name, linear in frozen_linears(layers).items():
        weight = linear.weight
        problem = nf4_shard_problem(weight.shape[0], weight.shape[1], world_size)
        if problem:
            raise ValueError(f"model.quantize nf4: {layer_prefix}.{name}.weight: {problem}; use a world size that "
                             "divides them or drop model.quantize")
        quantized = to_nf4(weight.detach(), BLOCK, scaler_block_size(weight.numel()))
        linear.weight = nn.Parameter(quantized, requires_grad=False)
        key = f"{layer_prefix}.{name}.weight".replace(CHECKPOINT_WRAPPER, "")
        keys[key] = base_name(key)
    if not keys:
        raise ValueError("model.quantize nf4: no frozen linear layer in the decoder blocks to quantize; "
                         "drop model.quantize")
    log.info("model.quantize nf4: %d frozen linear weights in 4 bits", len(keys))
    return keys


def is_quantized(param: torch.Tensor) -> bool:
    local = param._local_tensor if isinstance(param, DTensor) else param
    return type(local).__name__ == "NF4Tensor"


@torch.no_grad()
def load_quantized(model: nn.Module, path: str | Path, keys: dict[str, str], dtype: torch.dtype) -> None:
    """Fill each rank's NF4 shards from the safetensors files at ``path``: read the full weight (one at a time),
    cast it to ``dtype``, quantize it, copy the rank's rows of codes and scales into its shard."""
    from safetensors import safe_open

    from fsdpjob.orchestrator.core.weightfiles import weight_files

    params = {k.replace(CHECKPOINT_WRAPPER, ""): p for k, p in model.named_parameters()}
    wanted = {stored: key for key, stored in keys.items()}
    for file in weight_files(Path(path)) or []:
        with safe_open(str(file), framework="pt") as f:
            for stored in [s for s in f.keys() if s in wanted]:
                param = params[wanted.pop(stored)]
                sharded = isinstance(param, DTensor)  # else one rank's plain parameter (build.py)
                local = param._local_tensor if sharded else param
                full = f.get_tensor(stored).to(dtype)
                quantized = to_nf4(full, local.block_size, local.scaler_block_size)
                world, rank = (param.device_mesh.size(), param.device_mesh.get_local_rank()) if sharded else (1, 0)
                shard = torch.chunk(quantized, world, dim=0)[rank]
                # Set, not copy_: materializing (to_empty) allocates the codes and scales but leaves the per-tensor
                # scale mean and the NF4 code table on the meta device, where copy_ would write nothing.
                for attr in _NF4_TENSORS:
                    setattr(local, attr, getattr(shard, attr).to(local.device, copy=True))
    if wanted:
        raise ValueError(f"{path}: the weight files lack {sorted(wanted)[:3]} (model.quantize nf4)")
