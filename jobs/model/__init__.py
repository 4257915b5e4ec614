"""The model on the workers: build it on the meta device, shard it with FSDP2 (parallelize), read its weights
(weightload) and attach LoRA adapters (lora)."""

from fsdpjob.orchestrator.core.weightfiles import side_files

from .build import find_decoder_layers, load_model
from .lora import attach_lora, trainable_parameters
from .parallelize import apply_fsdp, build_mesh

__all__ = ["apply_fsdp", "attach_lora", "build_mesh", "find_decoder_layers", "load_model", "side_files",
           "trainable_parameters"]
