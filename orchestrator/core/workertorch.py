"""The workers' torch as this machine knows it, and the features that need a newer torch than the project's floor.

An image's torch is known once `fsdpjob check-image` (slurm/imagecheck.py) ran it: its answer is kept here per
image identity and host build. Without a container the workers run this venv's torch. validate and plan read it,
so that a feature the workers' torch lacks is refused before the queue, not at set-up or step 1 on the nodes.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from .buildid import build_id
from .jobspec.container import ContainerSpec


@dataclass(frozen=True)
class TorchNeed:
    loc: tuple[str, ...]  # the spec field that asks for the feature
    release: tuple[int, int]
    what: str  # what that torch brings
    fix: str


# The worker checks each again on its own torch (jobs/checkpoint/staging.py, jobs/model/build.py).
ASYNC_SAVE = TorchNeed(("checkpoint", "async_save"), (2, 9), "DCP's DefaultStager",
                       "set checkpoint.async_save: false")
VARLEN = TorchNeed(("model", "attn_implementation"), (2, 10), "torch's varlen flash attention",
                   "set model.attn_implementation: auto (it falls back to sdpa)")


def release(version: str) -> tuple[int, ...]:
    """(major, minor) of a torch version string such as 2.8.0a0+5228986c39."""
    return tuple(int(x) for x in re.findall(r"\d+", version.split("+")[0])[:2])


def needs(spec, gpus: bool) -> list[TorchNeed]:
    """The features this spec asks for that need a newer torch than the floor. (An explicit varlen on CPU runs
    SDPA per example, on any torch.)"""
    out = [ASYNC_SAVE] if spec.checkpoint.async_save else []
    if gpus and spec.model.attn_implementation == "varlen":
        out.append(VARLEN)
    return out


def torch_problems(spec, gpus: bool, worker_torch: str, source: str) -> list[tuple[tuple[str, ...], str]]:
    """(loc, message) for each feature ``worker_torch`` lacks; ``source`` says where that version was read."""
    return [(need.loc, f"needs torch >= {'.'.join(map(str, need.release))} ({need.what}), but the workers' torch is "
                       f"{worker_torch} ({source}): {need.fix}, or give the workers a newer torch")
            for need in needs(spec, gpus) if release(worker_torch) < need.release]


def checks_dir() -> Path:
    """Beside the user's other caches: a check is the same for every run of this host build and image."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "fsdpjob" / "image-checks"


def check_key(container: ContainerSpec, python: str) -> str:
    """The image's identity (a file's or folder's size, mtime and inode; a registry URI as written), its runtime
    and python, and the host's build: a rebuilt image or a new checkout checks again."""
    ident = container.image or f"name:{container.name}"
    if container.image and os.path.exists(container.image):
        st = os.stat(container.image)
        ident += f"|{st.st_size}|{st.st_mtime_ns}|{st.st_ino}"
    text = "|".join([str(container.runtime), ident, python, ",".join(container.mounts), build_id()])
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def recorded(key: str) -> dict | None:
    """A passing check's answer (the image's versions), or None."""
    try:
        return json.loads((checks_dir() / f"{key}.json").read_text())
    except (OSError, ValueError):
        return None


def host_torch() -> str | None:
    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return None
