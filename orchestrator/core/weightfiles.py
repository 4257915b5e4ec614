"""A Hugging Face folder's safetensors weights, read without torch: which files hold them, each file's
tensor table, and the files beside them (config, tokenizer). Shared by the planner (exact parameter counts)
and the worker (each rank's own shards, the data cache's key, export's side files)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
MAX_HEADER_BYTES = 100_000_000  # a longer header is a damaged file, not a model
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf")
_WEIGHT_INDEXES = (INDEX_FILE, "pytorch_model.bin.index.json")


def weight_files(folder: Path) -> list[Path] | None:
    """The folder's safetensors files (sharded with an index, or one file), sorted; None without any."""
    index = folder / INDEX_FILE
    if index.is_file():
        return [folder / name for name in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    if (folder / SINGLE_FILE).is_file():
        return [folder / SINGLE_FILE]
    return None


def read_header(file: Path) -> tuple[dict[str, dict], int]:
    """One file's tensor table (``__metadata__`` left out) and where its data starts: an 8-byte
    little-endian length, then that much JSON, then the data (``data_offsets`` count from there)."""
    with open(file, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        if length > MAX_HEADER_BYTES:
            raise ValueError(f"{file}: implausible safetensors header length {length}")
        header = json.loads(f.read(length))
    header.pop("__metadata__", None)
    return header, 8 + length


def side_files(model_dir: Path) -> list[Path]:
    """The model folder's top-level files other than weights and their index: config, tokenizer files,
    generation config, chat template. Export copies them; the data cache keys on them."""
    return [
        item for item in sorted(Path(model_dir).iterdir())
        if item.is_file() and item.name not in _WEIGHT_INDEXES and not item.name.endswith(_WEIGHT_SUFFIXES)
    ]
