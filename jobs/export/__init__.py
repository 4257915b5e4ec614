"""Export a checkpoint as a Hugging Face model folder: full weights (full) or LoRA adapters (lora)."""

from .full import ExportError, export_from_path, export_hf, write_shards

__all__ = ["ExportError", "export_from_path", "export_hf", "write_shards"]
