"""The model on the workers: build it on the meta device, shard it with FSDP2 (parallelize), read its weights
(weightload), attach LoRA adapters (lora), recompute activations (checkpointing)."""

from fsdpjob.orchestrator.core.weightfiles import side_files

from .build import find_decoder_layers, load_model
from .checkpointing import FULL, NONE, Checkpointing
from .lora import attach_lora, trainable_parameters
from .parallelize import apply_fsdp, build_mesh

__all__ = ["FULL", "NONE", "Checkpointing", "apply_fsdp", "attach_lora", "build_mesh", "find_decoder_layers",
           "load_model", "side_files", "trainable_parameters"]
