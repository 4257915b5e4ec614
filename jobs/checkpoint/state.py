"""Stateful wrappers for what a checkpoint holds: sharded model + optimizer, counters and data position,
and per-rank RNG streams (see RNGState for what happens when the world size changes)."""

from __future__ import annotations

import hashlib
import logging
import pickle
import random
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful

log = logging.getLogger("fsdpjob.checkpoint")

class ModelOptimState(Stateful):
    """Sharded model and optimizer state through get_state_dict/set_state_dict (works with FSDP2).

    ``trainable_only`` (LoRA): only parameters that train are saved and loaded; the frozen base comes from the
    model folder on every start. The load is not strict about the frozen ones, but DCP still fails on any
    trainable key the checkpoint lacks, since those are exactly the keys state_dict() asks it for.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, trainable_only: bool = False) -> None:
        self.model = model
        self.optimizer = optimizer
        self.options = StateDictOptions(ignore_frozen_params=True, strict=False) if trainable_only else None

    def state_dict(self) -> dict[str, Any]:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=self.options)
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_state_dict(
            self.model, self.optimizer, model_state_dict=state_dict["model"], optim_state_dict=state_dict["optim"],
            options=self.options,
        )


class DictState(Stateful):
    """Adapts an object with state_dict/load_state_dict (LR scheduler, data pipeline) to DCP.

    ``optional`` names keys added after checkpoints were already being written: a checkpoint without one
    still loads (the object keeps its default). DCP's load is strict otherwise, which is what we want for
    everything else: a missing weight must never pass silently.
    """

    def __init__(self, obj: Any, optional: tuple[str, ...] = ()) -> None:
        self.obj, self.optional = obj, optional
        self._absent: set[str] = set()

    def expect_keys(self, name: str, saved: set[str]) -> None:
        """Before a load: the checkpoint's flattened keys (``<name>.<key>``); absent optional keys are not asked for."""
        self._absent = {k for k in self.optional if f"{name}.{k}" not in saved}

    def state_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.obj.state_dict().items() if k not in self._absent}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.obj.load_state_dict(state_dict)
        self._absent = set()


def derived_seed(seed: int, step: int, rank: int) -> int:
    digest = hashlib.sha256(f"fsdpjob-rng/{seed}/{step}/{rank}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


class RNGState(Stateful):
    """Per-rank RNG state (torch CPU, CUDA when present, Python random, NumPy) under key rank<r>.

    Each rank saves only its own entry, a pickled bytes item, so nothing is gathered. On a load
    written by the same world size each rank reads its own entry back. On a different world size
    the per-rank streams cannot be mapped, so every rank re-seeds from (seed, step, rank) instead:
    the CheckpointManager calls ``expect_load`` with the writer's world size before dcp.load, and
    this object then asks DCP for no entries at all.
    """

    def __init__(self, seed: int, rank: int, world_size: int) -> None:
        self.seed, self.rank, self.world_size = seed, rank, world_size
        self._rederive: tuple[int, int] | None = None  # (step, writer's world size) of a resharded load

    def expect_load(self, *, saved_world_size: int, step: int) -> None:
        self._rederive = None if saved_world_size == self.world_size else (step, saved_world_size)

    def state_dict(self) -> dict[str, Any]:
        if self._rederive is not None:
            return {}
        return {f"rank{self.rank}": pickle.dumps(self._capture())}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        rederive, self._rederive = self._rederive, None
        if rederive is None:
            self._restore(pickle.loads(state_dict[f"rank{self.rank}"]))
            return
        step, saved_world_size = rederive
        self.reseed(step)
        log.info(
            "RNG state re-derived from (seed=%d, step=%d, rank=%d): the checkpoint was written by %d ranks, "
            "this run has %d", self.seed, step, self.rank, saved_world_size, self.world_size,
        )

    def reseed(self, step: int) -> None:
        value = derived_seed(self.seed, step, self.rank)
        torch.manual_seed(value)  # also seeds every CUDA device
        random.seed(value)
        np.random.seed(value % 2**32)

    @staticmethod
    def _capture() -> dict[str, Any]:
        state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["cuda"] = torch.cuda.get_rng_state()
        return state

    @staticmethod
    def _restore(state: dict[str, Any]) -> None:
        torch.set_rng_state(state["torch"])
        random.setstate(state["python"])
        np.random.set_state(state["numpy"])
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state(state["cuda"])


