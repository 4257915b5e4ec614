"""What a training run is made of (the model, its optimizer and LR schedule, the packed data, the counters), built
the same way on every rank for a fresh start, then resumed from a checkpoint tier's step when there is one."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh

from fsdpjob.orchestrator.core.jobspec.spec import JobSpec
from fsdpjob.orchestrator.core.runfolder import heartbeat, runlog
from fsdpjob.orchestrator.core.runfolder.paths import RunPaths

from .checkpoint.state import DictState, ModelOptimState, RNGState
from .checkpoint.tiers import ResumeSource
from .data.packing import SequenceTable, packing_mode
from .data.stream import BatchStream
from .dist import DistEnv
from .methods import method_row
from .model.build import load_model
from .model.checkpointing import Checkpointing
from .model.lora import trainable_parameters
from .optim import build_optimizer, lr_factor
from .report.metrics import Reporter
from .step import StepValues


@dataclass
class TrainState:
    """Training counters saved with every checkpoint."""

    step: int = 0
    tokens_seen: int = 0
    global_batch: int = 0
    # The last trained step's loss: a start that resumes from the final checkpoint trains no step
    # and still reports it. NaN before the first step (DCP keeps a float; None would need pickling).
    loaded_loss: float = float("nan")
    last: StepValues | None = None  # the last trained step's values, read when a save needs the loss
    # Keys added after checkpoints were already written (absent from older ones; see DictState).
    ADDED = ("loss",)

    @property
    def loss(self) -> float:
        """The last step's loss; reading a new step's is a collective (saves and the end read it on every rank)."""
        return self.last.loss if self.last is not None else self.loaded_loss

    def state_dict(self) -> dict:
        return {"step": self.step, "tokens_seen": self.tokens_seen, "global_batch": self.global_batch,
                "loss": self.loss}

    def load_state_dict(self, state: dict) -> None:
        self.step, self.tokens_seen = int(state["step"]), int(state["tokens_seen"])
        self.global_batch, self.loaded_loss = int(state["global_batch"]), float(state.get("loss", float("nan")))
        self.last = None


@dataclass
class TrainParts:
    """What build() makes, the same on every rank; resume then loads the counters and the state into it."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    table: SequenceTable
    state: TrainState
    mesh: DeviceMesh
    eval_table: SequenceTable | None = None  # data.eval_path, or the data.eval_fraction held out of table
    train_rows: torch.Tensor | None = None  # with eval_fraction: table's rows in the packed data (sample logs)
    separate_root: bool = False  # fsdp.separate_root as resolved (a second copy of the model is sharded the same)


def build(spec: JobSpec, paths: RunPaths, env: DistEnv, report: Reporter, mesh: DeviceMesh, *,
          read_weights: bool = True, worker_facts: dict | None = None) -> TrainParts:
    """The model (meta init on every rank, FSDP2 wrap, each rank reading its own shards of the weights, or rank 0
    reading and broadcasting where that cannot be done: model/weightload.py; none read when a checkpoint will
    overwrite them all), its optimizer and LR schedule, the packed data, and counters for a fresh start.
    ``worker_facts``: the planner's decisions (spec.json), read for fsdp.separate_root: auto."""
    heartbeat.enter(heartbeat.MODEL_LOAD)
    separate_root = resolve_separate_root(spec.fsdp.separate_root, worker_facts or {})
    model = load_model(
        spec.model.path, env=env, mesh=mesh, dtype=getattr(torch, spec.model.dtype),
        attn_implementation=spec.model.attn_implementation, mixed_precision=spec.fsdp.mixed_precision,
        reshard_after_forward=spec.fsdp.reshard_after_forward, reduce_dtype=getattr(torch, spec.fsdp.reduce_dtype),
        activation_checkpointing=Checkpointing.of(spec.model.activation_checkpointing, spec.model.selective_ac),
        cpu_offload=spec.fsdp.cpu_offload, separate_root=separate_root,
        compile_layers=spec.model.compile,
        lora=spec.model.lora,
        quantize=spec.model.quantize,
        read_weights=read_weights,
        packed=packing_mode(spec.data.packing) == "boundary",
        **method_row(spec.train.method).head(spec),
    )
    model.train()
    train = spec.train
    optimizer = build_optimizer(trainable_parameters(model), train)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(
        s, max_steps=train.max_steps, warmup_steps=train.warmup_steps,
        schedule=train.lr_schedule, min_lr_ratio=train.min_lr_ratio))
    state = TrainState(global_batch=train.micro_batch_size * train.grad_accum_steps * env.world_size)
    table, eval_table, train_rows = _load_data(spec, paths, env, report)
    return TrainParts(model, optimizer, scheduler, table, state, mesh, eval_table, train_rows, separate_root)


def resolve_separate_root(setting: str | bool, worker_facts: dict) -> bool:
    """fsdp.separate_root: true and false as given; auto what the planner decided (worker fact ``separate_root``,
    whether it lowers the planned peak), false for a run folder whose plan did not say (written before it did)."""
    if isinstance(setting, bool):
        return setting
    return bool(worker_facts.get("separate_root", False))


def _load_data(spec: JobSpec, paths: RunPaths, env: DistEnv,
               report: Reporter) -> tuple[SequenceTable, SequenceTable | None, torch.Tensor | None]:
    """The method's data (its row's reader: jobs/methods.py), read the same way on every rank (each rank later
    reads its own slice). Returns the training table, the eval table (or None) and, with eval_fraction, the
    training rows' places in the full data."""
    from transformers import AutoTokenizer

    heartbeat.enter(heartbeat.DATA_LOAD)
    tokenizer = AutoTokenizer.from_pretrained(spec.model.path)
    return method_row(spec.train.method).read_data(spec, paths, env, report, tokenizer)


def resume(parts: TrainParts, spec: JobSpec, env: DistEnv, source: ResumeSource | None, report: Reporter,
           stream_for: Callable[[int], Any] | None = None) -> tuple[BatchStream, dict[str, Any]]:
    """Load ``source`` (checkpoint/tiers.find_resume_source's) if there is one; return the data stream and the state
    every save writes.

    Two loads: the counters first, because the checkpoint's global batch (kept on any world size) sizes the
    data stream, which must exist before the second load restores its position.
    """
    heartbeat.enter(heartbeat.CHECKPOINT_LOAD)
    started = time.monotonic()
    state = parts.state
    train_state = DictState(state, optional=TrainState.ADDED)
    if source is not None:
        source.load({"train": train_state})
    grad_accum = _grad_accum(state.global_batch, spec.train.micro_batch_size, env.world_size)
    # grpo's stream (rounds of generations over its prompts) is the method's own, made for this start's batch.
    stream = stream_for(grad_accum) if stream_for is not None else BatchStream(
        parts.table, seed=spec.train.seed, shuffle=spec.data.shuffle, micro_batch_size=spec.train.micro_batch_size,
        grad_accum_steps=grad_accum, dp_rank=env.rank, dp_world=env.world_size,
        packing=packing_mode(spec.data.packing))
    model_state = ModelOptimState(parts.model, parts.optimizer, trainable_only=spec.model.lora is not None)
    app_state = {"model": model_state, "scheduler": DictState(parts.scheduler),
                 "train": train_state, "data": DictState(stream, optional=stream.ADDED),
                 "rng": RNGState(spec.train.seed, env.rank, env.world_size)}
    if source is not None:
        source.load(app_state)
        report.event(runlog.RESUME, step=state.step, checkpoint=source.where, tier=source.tier,
                     world_size=env.world_size, grad_accum_steps=grad_accum,
                     load_s=round(time.monotonic() - started, 3),
                     **({"passed_over": list(source.passed_over)} if source.passed_over else {}))
    return stream, app_state


def _grad_accum(global_batch: int, micro_batch_size: int, world_size: int) -> int:
    per_step = micro_batch_size * world_size
    if global_batch % per_step:
        raise ValueError(
            f"cannot keep the checkpoint's global batch of {global_batch} sequences on {world_size} ranks with "
            f"micro_batch_size {micro_batch_size}: {global_batch} is not divisible by {per_step}; "
            "pick a world size or micro-batch size that divides it"
        )
    return global_batch // per_step
