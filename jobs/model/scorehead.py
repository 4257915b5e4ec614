"""A reward model (train.method reward): the causal LM's backbone with a scalar head, the class
``AutoModelForSequenceClassification.from_pretrained(path, num_labels=1)`` loads (Llama: LlamaForSequenceClassification,
``score`` a Linear(hidden, 1, bias=False)), built like the causal LM: meta init, FSDP2, each rank reading its own
shards of the base weights.

The base folder holds a causal LM: its backbone's tensors keep their names in the classifier (both classes put the
backbone under ``base_model_prefix``), its LM head's are not read, and the score head is new. Its first values are
drawn as transformers' own init draws them (normal, std ``initializer_range``) on rank 0 from its RNG (seeded by
train.seed) inside fork_rng, as LoRA's first values are (jobs/model/lora.py): the start is the same on any world
size and no rank's random stream moves. A resume reads the head from the checkpoint with every other weight.

The score of a row is what the classifier's own forward returns: the head at the row's rightmost token that is not
``config.pad_token_id``. The config gets the pad id the data is padded with, so training and the exported model
(whose config carries it) read the same position: the last real token of a right-padded row.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.tensor import DTensor, distribute_tensor

from .weightload import CHECKPOINT_WRAPPER, load_sharded

log = logging.getLogger("fsdpjob.jobs.model")

HEAD = "score"  # transformers' name of the sequence classifier's head (GenericForSequenceClassification)


def classifier_on_meta(config, *, attn_implementation: str, dtype: torch.dtype, pad_token_id: int | None) -> nn.Module:
    """The sequence classifier of ``config`` with one label, on the meta device."""
    from transformers import AutoModelForSequenceClassification

    config.num_labels = 1
    if pad_token_id is not None:
        config.pad_token_id = pad_token_id
    with torch.device("meta"):
        return AutoModelForSequenceClassification.from_config(config, attn_implementation=attn_implementation,
                                                              dtype=dtype)


def _draw_head(model: nn.Module, env) -> torch.Tensor:
    """The head's first values on rank 0 (the shape elsewhere), on the device the collectives use."""
    weight = model.get_submodule(HEAD).weight
    full = torch.empty(weight.shape, dtype=weight.dtype, device=env.device)
    if env.is_main:
        std = getattr(model.config, "initializer_range", 0.02)  # transformers' init of a new Linear head
        with torch.random.fork_rng(devices=[]):
            cpu = torch.empty(weight.shape, dtype=torch.float32).normal_(0.0, std)
        full.copy_(cpu)
    return full


@torch.no_grad()
def load_classifier(model: nn.Module, path: Path, env, causal_keys: set[str],
                    read_causal: Callable[[], dict[str, torch.Tensor]]) -> None:
    """Fill the materialized sharded classifier: the backbone from the folder's causal LM (``causal_keys``: its
    state-dict keys), each rank its own shards, or where that cannot be done ``read_causal`` (rank 0 reads the
    causal LM's full state dict, the other ranks get an empty one) and a broadcast; the head from its first
    values."""
    prefix = model.base_model_prefix
    backbone = model.get_submodule(prefix)
    names = {k.replace(CHECKPOINT_WRAPPER, "") for k in backbone.state_dict()}
    own = {f"{prefix}.{k}" for k in names}
    lm_head = causal_keys - own  # stored, never read: the classifier has the score head instead
    head = _draw_head(model, env)
    if load_sharded(backbone, path, names, [], ignore=lm_head):
        weight = model.get_submodule(HEAD).weight
        if isinstance(weight, DTensor):
            part = distribute_tensor(head, weight.device_mesh, weight.placements, src_data_rank=0)
            weight.to_local().copy_(part.to_local())
        else:
            dist.broadcast(head, src=0)
            weight.copy_(head)
        log.info("loaded the backbone of %s into FSDP2 shards on rank %d; new %s head", path, env.rank, HEAD)
        return
    full = read_causal()
    if full:
        full = {**{k: full[k] for k in own}, f"{HEAD}.weight": head.cpu()}
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    log.info("loaded the backbone of %s (rank 0 read) on rank %d; new %s head", path, env.rank, HEAD)
