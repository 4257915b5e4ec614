"""Tiny FSDP2 training pieces for the checkpoint tests, and a driver process a test can SIGKILL mid-save.

Run as a script (one process per rank, env RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT set):
``python ckpt_driver.py ROOT`` trains one step, saves step 1, trains one more, saves step 2. With
FSDPJOB_FAULT_SAVE_PAUSE_S/_RANK/_STEP set, the save of step 2 pauses so the test can kill a rank.
"""

from __future__ import annotations

import logging
import os
import random
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from fsdpjob.jobs.checkpoint import CheckpointManager, plain_writer
from fsdpjob.jobs.checkpoint.state import DictState, ModelOptimState, RNGState
from fsdpjob.jobs.hooks import TestHooks

SEED = 7
FINGERPRINT = {"model.path": "tiny-llama", "model.dtype": "float32", "data.seq_len": 16}


def tiny_config(tie: bool = False) -> Any:
    from fsdpjob.jobs.quickstart import tiny_config as config

    return config("llama", vocab_size=128, hidden_size=32, intermediate_size=64, max_position_embeddings=64,
                  tie_word_embeddings=tie)


class DataPosition:
    """Stands in for the data pipeline: a small dict of ints, identical on every rank."""

    def __init__(self) -> None:
        self.samples = 0

    def state_dict(self) -> dict[str, int]:
        return {"samples": self.samples}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.samples = state["samples"]


class Trainer:
    """Tiny Llama + AdamW + LambdaLR, FSDP2-sharded when a process group exists; batches come from the RNGs."""

    def __init__(self, rank: int, world_size: int, init_seed: int = 0, tie: bool = False) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from transformers import LlamaForCausalLM

        torch.manual_seed(init_seed)
        self.model = LlamaForCausalLM(tiny_config(tie))
        if dist.is_initialized():
            mesh = init_device_mesh("cpu", (world_size,))
            for layer in self.model.model.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(self.model, mesh=mesh)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-2, weight_decay=0.1)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: 1.0 / (1 + s))
        self.data = DataPosition()
        self.train = {"step": 0, "tokens_seen": 0, "samples_consumed": 0}
        self.rng = RNGState(SEED, rank, world_size)
        self.rng.reseed(0)

    def state(self) -> dict[str, Any]:
        return {
            "model": ModelOptimState(self.model, self.optimizer),
            "rng": self.rng,
            "scheduler": DictState(self.scheduler),
            "train": self.train,
            "data": DictState(self.data),
        }

    def step(self) -> float:
        # Batches depend on all three RNG streams, so a wrongly restored RNG changes the losses.
        length = 12 + random.randrange(3) + int(np.random.randint(0, 2))
        tokens = torch.randint(0, 128, (2, length))
        loss = self.model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad()
        self.train["step"] += 1
        self.train["tokens_seen"] += 2 * 16  # plain entries must agree across ranks: DCP keeps one copy
        self.train["samples_consumed"] += 2
        self.data.samples += 2
        return loss.item()

    def full_state(self) -> dict[str, Any]:
        """Unsharded model and optimizer state (collective); filled on every rank."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=False)
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=options)
        # Copies: on one rank (and for AdamW's step counters) these tensors alias the live state.
        return _cloned({"model": model_sd, "optim": optim_sd})


def _cloned(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: _cloned(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cloned(v) for v in obj)
    return obj


def rng_snapshot() -> tuple:
    return (torch.get_rng_state(), random.getstate(), np.random.get_state())


def manager(root: Path, rank: int, world_size: int, **kwargs: Any) -> CheckpointManager:
    """A manager with the fault-injection hooks of this process's environment (FSDPJOB_FAULT_SAVE_*)."""
    options = {"keep_last": 3, "async_save": False, "storage_writer": TestHooks.from_env().wrap_writer(plain_writer)}
    options |= kwargs
    sidecar = {"fingerprint": FINGERPRINT, "spec_hash": "test", "mesh_shape": [world_size]}
    sidecar |= options.pop("sidecar", {})
    return CheckpointManager(root, rank=rank, world_size=world_size, sidecar=sidecar, **options)


def main() -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(name)s %(levelname)s %(message)s")
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    trainer = Trainer(rank, world_size)
    ckpt = manager(Path(sys.argv[1]), rank, world_size)
    for step in (1, 2):
        trainer.step()
        ckpt.save(step, trainer.state(), reason="interval")
        print(f"saved {step}", flush=True)
    ckpt.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
