"""Tokenize once per run, not once per start or per rank.

Tokenizing and packing the whole data file on every rank costs minutes of every start on a real data set, and
every rank of a node competes for the same cores. Rank 0 tokenizes, saves the packed table in the run folder as
safetensors, and the other ranks that share the folder wait for it and read it (issue 54 item 3); a rank whose
node does not share it tokenizes itself. Every later
start (requeue after preemption or time limit, resume) reads it back, on every rank, when its key
matches: the names and bytes of every data file (each source's), the tokenizer's files, the data settings
(sources and weights, packing mode and long_examples included) and the pad id. A cache that is missing, stale or
unreadable is rebuilt,
never trusted; a half-written one never exists (write, fsync, rename). Without a shared run folder the
other nodes simply keep tokenizing themselves.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from fsdpjob.orchestrator.core.jobspec.spec import DataSpec
from fsdpjob.orchestrator.core.weightfiles import side_files

from .packing import SequenceTable
from .sources import data_files

log = logging.getLogger("fsdpjob.data")

FORMAT = 2  # bump when build_sequences or read_examples change what they produce
_CHUNK = 1 << 20
# Tensors only some tables have: a mixture's row sources, boundary-aware packing's positions, the rows' lengths.
_OPTIONAL = ("source", "position_ids", "lengths")


def _hash_file(h: hashlib._Hash, path: Path) -> None:
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)


def table_key(data: DataSpec, model_path: str | Path, pad_id: int) -> str:
    """What the packed table depends on. The model folder's side files stand for the tokenizer
    (tokenizer.json, its config, special tokens, chat template); the weights cannot change the tokens."""
    h = hashlib.sha256()
    h.update(json.dumps({"format": FORMAT, "data": data.model_dump(mode="json"), "pad_id": pad_id},
                        sort_keys=True).encode())
    for path in data_files(data):  # every source's files, named: a renamed or added file changes the order
        h.update(str(path).encode() + b"\0")
        _hash_file(h, path)
    for path in side_files(Path(model_path)):
        h.update(path.name.encode() + b"\0")
        _hash_file(h, path)
    return h.hexdigest()


def _cache_file(cache_dir: Path, key: str) -> Path:
    return cache_dir / f"sequences-{key[:32]}.safetensors"


def _read(path: Path, key: str) -> SequenceTable | None:
    try:
        with safe_open(path, framework="pt") as f:
            meta = f.metadata() or {}
            if meta.get("key") != key:
                return None
            ids, labels = f.get_tensor("input_ids"), f.get_tensor("labels")
            optional = {name: f.get_tensor(name) if name in f.keys() else None for name in _OPTIONAL}
        if ids.shape != labels.shape or ids.dim() != 2 or ids.dtype != torch.long:
            return None
        weights = tuple(json.loads(meta["weights"])) if optional["source"] is not None else None
        return SequenceTable(ids, labels, int(meta["num_examples"]), int(meta["truncated"]), weights=weights,
                             split=int(meta["split"]), dropped=int(meta["dropped"]), **optional)
    except (OSError, KeyError, ValueError, SafetensorError) as exc:
        log.warning("data cache %s unreadable (%s); tokenizing again", path, exc)
        return None


def _write(cache_dir: Path, key: str, table: SequenceTable) -> Path:
    cache_dir.mkdir(parents=True, exist_ok=True)
    path = _cache_file(cache_dir, key)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tensors = {"input_ids": table.input_ids.contiguous(), "labels": table.labels.contiguous()}
    tensors |= {name: getattr(table, name).contiguous() for name in _OPTIONAL if getattr(table, name) is not None}
    meta = {"key": key, "num_examples": str(table.num_examples), "truncated": str(table.truncated),
            "split": str(table.split), "dropped": str(table.dropped)}
    if table.source is not None:
        meta["weights"] = json.dumps(list(table.weights))
    save_file(tensors, tmp, metadata=meta)
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)
    for old in cache_dir.glob("sequences-*.safetensors"):  # another data file or tokenizer: stale for good
        if old != path:
            old.unlink(missing_ok=True)
    return path


def load_or_build(data: DataSpec, model_path: str | Path, pad_id: int, cache_dir: Path, *, is_main: bool,
                  build: Callable[[], SequenceTable], agree: Callable[[], None] | None = None,
                  wait: Callable[[], None] = lambda: time.sleep(0.5)) -> tuple[SequenceTable, bool]:
    """The packed table, and whether it came from the cache. Only ``is_main`` writes the cache.

    ``agree`` (the process group's barrier; None: a single process) makes the data tokenized once per job:
    rank 0 claims the build in the cache folder before it, and a rank that sees the claim after it waits for the
    table instead of tokenizing too (``wait`` between looks). A rank that does not see it (a run folder its node
    does not share) tokenizes itself. The barrier is passed at once: the ranks arrive together from the model
    build, and none waits in a collective while rank 0 tokenizes (its timeout would end a long one)."""
    key = table_key(data, model_path, pad_id)
    path = _cache_file(cache_dir, key)
    table = _read(path, key) if path.is_file() else None
    claim = path.with_name(f".{path.name}.claim")
    if agree is not None:  # every rank passes it, whether it read a table or not (a node may see none)
        if is_main and table is None:
            _claim(claim)
        elif is_main:
            claim.unlink(missing_ok=True)  # an earlier attempt's, killed after its write
        agree()
    if table is not None:
        return table, True
    if agree is not None:
        if not is_main and claim.is_file():
            table = _wait_for(path, claim, key, wait)
            if table is not None:
                return table, True
    table = build()
    if is_main:
        try:
            _write(cache_dir, key, table)
        except (OSError, SafetensorError) as exc:  # a cache is an optimisation: a full disk must not stop training
            # (safetensors reports a failed write, ENOSPC or EFBIG, as its own error, not an OSError)
            log.warning("could not write the data cache in %s (%s); later starts tokenize again", cache_dir, exc)
        finally:
            claim.unlink(missing_ok=True)  # the waiters then read the table, or tokenize themselves
    return table, False


def _claim(claim: Path) -> None:
    """Rank 0's mark that it tokenizes now: its host and pid, written whole (a requeue's claim replaces the
    killed attempt's)."""
    claim.parent.mkdir(parents=True, exist_ok=True)
    tmp = claim.with_name(f"{claim.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps({"machine": os.uname().nodename, "pid": os.getpid()}))
    os.replace(tmp, claim)


def _wait_for(path: Path, claim: Path, key: str, wait: Callable[[], None]) -> SequenceTable | None:
    """Rank 0's table once it is there; None when the claim goes without one (rank 0 could not write it) or its
    writer died on this machine (a killed rank 0 leaves only its temporary file, which nobody reads)."""
    while True:
        if path.is_file():
            return _read(path, key)
        if not claim.is_file() or _claimer_gone(claim):
            return _read(path, key) if path.is_file() else None
        wait()


def _claimer_gone(claim: Path) -> bool:
    try:
        who = json.loads(claim.read_text())
    except (OSError, ValueError):
        return False  # replaced or removed right now: looked at again
    if who.get("machine") != os.uname().nodename:
        return False  # another node's process: the supervisor ends this step if it dies
    return not Path(f"/proc/{who.get('pid')}").exists()
