"""A Hugging Face folder's safetensors weights, read without torch: which files hold them, and each file's
tensor table. Shared by the planner (exact parameter counts) and the worker (each rank's own shards)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
MAX_HEADER_BYTES = 100_000_000  # a longer header is a damaged file, not a model


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
