"""The training worker: build, resume, then one loop that steps, logs and lets the checkpointer save or stop."""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from fsdpjob.orchestrator.core import heartbeat, memtier, runlog
from fsdpjob.orchestrator.core.ckptlayout import step_dir_name
from fsdpjob.orchestrator.core.paths import RunPaths
from fsdpjob.orchestrator.core.runmeta import RunMeta
from fsdpjob.orchestrator.core.sidecar import RunFacts
from fsdpjob.orchestrator.core.spec import JobSpec

from . import gcpolicy, preemption
from .checkpoint.manager import CheckpointManager
from .checkpoint.memory import MemoryTier
from .checkpoint.state import DictState, ModelOptimState, RNGState
from .data.cache import load_or_build
from .data.packing import SequenceTable, packing_mode
from .data.sources import build_table, eval_spec
from .data.stream import BatchStream, split_eval
from .dist import (
    DistEnv,
    close_distributed,
    control_group,
    export_group,
    host_barrier,
    init_distributed,
    share_from_rank0,
)
from .evaluate import Evaluator
from .hooks import TestHooks
from .metrics import Reporter, model_flops_per_token
from .model.build import load_model
from .model.lora import checkpoint_fingerprint, trainable_parameters
from .model.parallelize import build_mesh
from .savepolicy import Checkpointer
from .schedule import lr_factor
from .step import StepValues, train_step
from .workerenv import WorkerEnv, process_started_at

log = logging.getLogger("fsdpjob.train")


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


def run(run_dir: str, stop: preemption.StopFlag | None = None) -> dict:
    os.umask(0o077)  # run folders hold checkpoints and logs of the user's data: owner only
    paths = RunPaths(Path(run_dir))
    meta = RunMeta.read(paths.run_dir)
    spec = JobSpec.model_validate(meta.spec)
    # First thing on every rank: our flag-only handlers replace submitit's (see preemption.py).
    stop = stop or preemption.StopFlag(spec.preemption.signal)
    worker, hooks = WorkerEnv.from_env(), TestHooks.from_env()
    _setup_logging(worker.log_rank)
    heartbeat.enter(heartbeat.PROCESS_GROUP)
    env = init_distributed(spec.fsdp.collective_timeout_s, cpu_offload=spec.fsdp.cpu_offload, worker=worker)
    train = spec.train
    report = Reporter(paths.run_dir, enabled=env.is_main, max_steps=train.max_steps, log_every=train.log_every)
    ckpt, state, crashed, control, tier, completed = None, None, False, None, None, False
    try:
        t_start = time.time()
        torch.manual_seed(train.seed)
        report.event(runlog.START, restart=worker.restart_count, world_size=env.world_size, job_id=worker.job_id,
                     host=worker.host, launch=worker.launch, process_started_at=process_started_at())
        report.open_trackers(spec)  # W&B and MLflow (spec logging) on rank 0; a missing package stops here
        mesh = build_mesh(env, spec.fsdp.replicate_degree)
        ckpt = open_checkpoints(spec, meta.checkpoint_root(paths), env, mesh, hooks)
        tier = open_memory_tier(spec, ckpt, env, worker, paths, meta.profile.get("expected_interruptions_per_day"))
        source = find_resume_source(ckpt, tier, meta.resume_from)
        parts = build(spec, paths, env, report, mesh,
                      # A full fine-tune's checkpoint holds every weight: a resume reads no base weights (at 70B,
                      # minutes of every restart); LoRA's holds the adapters only.
                      read_weights=source is None or spec.model.lora is not None)
        state, model, scheduler = parts.state, parts.model, parts.scheduler
        stream, app_state = resume(ckpt, parts, spec, env, source, report)
        if tier is not None:
            tier.forget_after(state.step)
        report.event(runlog.READY, step=state.step, setup_s=round(time.time() - t_start, 2))

        control = control_group(env)  # host-side agreements, off the GPU stream
        # The ranks' wait for rank 0's export, on gloo with the export phase's own bound (not the collectives').
        waits_export = export_group(heartbeat.export_wait_s(spec.recovery.setup_timeout_s, spec.recovery.stall_floor_s)) \
            if spec.checkpoint.export_final and env.world_size > 1 else control
        defer_grad_sync = bool(meta.worker_facts.get("defer_grad_sync"))  # the planner's memory verdict
        evaluator = _evaluator(spec, parts, env, report)
        saver = Checkpointer(ckpt, spec.checkpoint, max_steps=train.max_steps, stop=stop, control=control,
                             report=report, hooks=hooks,
                             eval_loss_at=evaluator.loss_at if evaluator else None)
        start_step = state.step
        trained = sum(p.numel() for p in model.parameters() if p.requires_grad)  # global sizes (DTensor numel)
        flops_per_token = model_flops_per_token(model.config, seq_len=spec.data.seq_len,
                                                trained_params=trained if spec.model.lora else None)
        report.begin_training(state.step, flops_per_token=flops_per_token, device=env.device, world_size=env.world_size)
        gcpolicy.start()  # the collector runs between steps, not inside them
        while state.step < train.max_steps:
            step_started = time.monotonic()
            heartbeat.at_step(state.step, heartbeat.NEXT_BATCH)
            hooks.maybe_hang_in_data(state.step, env.rank)
            batch = stream.next_step()
            heartbeat.enter(heartbeat.STEP)
            saver.before_step(state.step + 1)  # every few steps, the stop/save flags travel while the step trains
            state.last = train_step(model, parts.optimizer, batch.micro_batches, env.device, tokens=batch.tokens,
                                    max_grad_norm=train.max_grad_norm, defer_grad_sync=defer_grad_sync,
                                    processed=batch.processed)
            if hooks.log_samples:
                _log_samples(paths, state.step + 1, batch.micro_batches, env, parts.train_rows)
            lr = scheduler.get_last_lr()[0]
            scheduler.step()
            state.step += 1
            state.tokens_seen += state.last.tokens
            report.on_step(state.step, state.last, lr=lr, tokens_seen=state.tokens_seen)
            hooks.pace(step_started)
            hooks.maybe_freeze(state.step, env.rank)
            gcpolicy.after_step(state.step)
            if evaluator:
                evaluator.maybe_run(state.step)
            if tier is not None:
                if tier.due(state.step, train.max_steps):
                    tier.save(state.step, app_state)
                if choice := tier.take_auto_choice():  # once per launch, with memory_interval_steps: auto
                    report.event(runlog.MEMORY_TIER, at_step=state.step, **asdict(choice))
            hooks.maybe_exit(state.step)
            if signum := saver.after_step(state.step, app_state):
                # Every rank leaves here (SystemExit), the way rank 0 decided; the supervisor requeues.
                preemption.stop_and_hand_off(signum, state.step, is_main=env.is_main, stop=stop, worker=worker,
                                             max_requeues=spec.preemption.max_requeues,
                                             save_started=saver.save_started, run_dir=paths.run_dir,
                                             ending=report.ending,
                                             share=lambda outcome: share_from_rank0(outcome, control))

        heartbeat.at_step(state.step, heartbeat.FINISH)
        if evaluator:
            evaluator.run_final(state.step, start_step)
        if not hooks.skip_final_save:
            saver.save_final(state.step, app_state)
        heartbeat.enter(heartbeat.EXPORT)
        _export_final(spec, paths, ckpt, env, report)
        # The other ranks wait for rank 0's export on gloo, bounded by the export's own bound (export_group), not
        # on NCCL or the default group, whose fsdp.collective_timeout_s a large export can outlast.
        host_barrier(waits_export)
        report.event(runlog.DONE, step=state.step, loss=None if math.isnan(state.loss) else state.loss)
        completed = True
        return {"rank": env.rank, "step": state.step, "status": "completed"}
    except SystemExit:
        raise
    except BaseException as exc:
        crashed = True
        # The step reached counts the steps this crash loses (fsdpjob status: steps lost).
        report.event(runlog.FAILED, all_ranks=True, rank=env.rank, error=f"{type(exc).__name__}: {exc}"[:2000],
                     retryable=_retryable(exc), step=state.step if state else None)
        raise
    finally:
        gcpolicy.stop()
        if tier is not None:
            # The job's end removes the node's tier; a crash leaves it for the next launch's resume.
            tier.close(remove=completed, crashed=crashed)
        if ckpt is not None:
            ckpt.close()
        report.close()
        close_distributed(abort=crashed)


def build(spec: JobSpec, paths: RunPaths, env: DistEnv, report: Reporter, mesh: DeviceMesh, *,
          read_weights: bool = True) -> TrainParts:
    """The model (meta init on every rank, FSDP2 wrap, each rank reading its own shards of the weights, or rank 0
    reading and broadcasting where that cannot be done: model/weightload.py; none read when a checkpoint will
    overwrite them all), its optimizer and LR schedule, the packed data, and counters for a fresh start."""
    heartbeat.enter(heartbeat.MODEL_LOAD)
    model = load_model(
        spec.model.path, env=env, mesh=mesh, dtype=getattr(torch, spec.model.dtype),
        attn_implementation=spec.model.attn_implementation, mixed_precision=spec.fsdp.mixed_precision,
        reshard_after_forward=spec.fsdp.reshard_after_forward,
        activation_checkpointing=spec.model.activation_checkpointing, cpu_offload=spec.fsdp.cpu_offload,
        compile_layers=spec.model.compile,
        lora=spec.model.lora,
        read_weights=read_weights,
        packed=packing_mode(spec.data.packing) == "boundary",
    )
    model.train()
    train = spec.train
    # Fused on every device (torch has had a CPU kernel since 2.4): one kernel over all of this rank's shards,
    # where torch's default on CPU runs several DTensor ops per parameter (bench/RESULTS.md "Fused AdamW, fewer
    # ops around the step, and an in-process A/B"), and no temporaries (foreach AdamW, the default on CUDA,
    # holds one more shard-sized copy; the planner assumes none).
    optimizer = torch.optim.AdamW(
        trainable_parameters(model), lr=train.lr, betas=train.betas, weight_decay=train.weight_decay, fused=True,
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(
        s, max_steps=train.max_steps, warmup_steps=train.warmup_steps,
        schedule=train.lr_schedule, min_lr_ratio=train.min_lr_ratio))
    state = TrainState(global_batch=train.micro_batch_size * train.grad_accum_steps * env.world_size)
    table, eval_table, train_rows = _load_data(spec, paths, env, report)
    return TrainParts(model, optimizer, scheduler, table, state, mesh, eval_table, train_rows)


def _load_data(spec: JobSpec, paths: RunPaths, env: DistEnv,
               report: Reporter) -> tuple[SequenceTable, SequenceTable | None, torch.Tensor | None]:
    """Tokenized and packed the same way on every rank (each rank later reads its own slice); cached per run.
    Returns the training table, the eval table (or None) and, with eval_fraction, the training rows' places
    in the packed data."""
    from transformers import AutoTokenizer

    heartbeat.enter(heartbeat.DATA_LOAD)
    tokenizer = AutoTokenizer.from_pretrained(spec.model.path)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    t_data = time.time()

    def packed(data, cache_dir: Path) -> tuple[SequenceTable, bool]:
        return load_or_build(data, spec.model.path, pad_id, cache_dir, is_main=env.is_main,
                             build=lambda: build_table(data, tokenizer, pad_id))

    table, cached = packed(spec.data, paths.cache_dir)
    eval_table, train_rows, extra = None, None, {}
    if spec.data.eval_fraction:
        table, eval_table, train_rows, _ = split_eval(table, spec.data.eval_fraction, spec.train.seed)
    elif spec.data.eval_path is not None:
        # Its own cache folder: a cache folder keeps only its newest table.
        eval_table, _ = packed(eval_spec(spec.data), paths.cache_dir / "eval")
    if eval_table is not None:
        extra = {"eval_sequences": len(eval_table)}
    report.event(runlog.DATA, sequences=len(table), examples=table.num_examples, truncated=table.truncated,
                 split=table.split, dropped=table.dropped, packing_efficiency=round(table.efficiency, 4),
                 cached=cached, seconds=round(time.time() - t_data, 2), **extra)
    return table, eval_table, train_rows


def _evaluator(spec: JobSpec, parts: TrainParts, env: DistEnv, report: Reporter) -> Evaluator | None:
    if not spec.train.eval_every or parts.eval_table is None:
        return None
    return Evaluator(parts.model, parts.eval_table, eval_every=spec.train.eval_every,
                     max_batches=spec.train.eval_batches, micro_batch_size=spec.train.micro_batch_size,
                     rank=env.rank, world_size=env.world_size, device=env.device, report=report)


def open_checkpoints(spec: JobSpec, root: Path, env: DistEnv, mesh: DeviceMesh,
                     hooks: TestHooks) -> CheckpointManager:
    return CheckpointManager(
        root,
        rank=env.rank, world_size=env.world_size, keep_last=spec.checkpoint.keep_last,
        keep_best=spec.checkpoint.keep_best,
        async_save=spec.checkpoint.async_save, storage_writer=hooks.storage_writer,
        sidecar=RunFacts(spec_hash=spec.spec_hash(), fingerprint=checkpoint_fingerprint(spec),
                         mesh_shape=tuple(mesh.shape), model_path=spec.model.path),
    )


def open_memory_tier(spec: JobSpec, ckpt: CheckpointManager, env: DistEnv, worker: WorkerEnv,
                     paths: RunPaths, interruptions_per_day: float | None = None) -> MemoryTier | None:
    """The memory tier (checkpoint.memory_interval_steps), keyed by this job and Slurm attempt: a requeue (a new
    allocation) resumes from the durable tier. Outside Slurm the run folder stands for the job."""
    if not spec.checkpoint.memory_interval_steps:
        return None
    import hashlib

    job = worker.job_id or "run-" + hashlib.sha256(str(paths.run_dir.resolve()).encode()).hexdigest()[:12]
    key = memtier.TierKey(job=job, restart=worker.restart_count, spec_hash=ckpt.run.spec_hash or "")
    base = os.environ.get(memtier.BASE_VAR) or memtier.DEFAULT_BASE
    return MemoryTier(base, key, rank=env.rank, world_size=env.world_size,
                      interval_steps=spec.checkpoint.memory_interval_steps, run=ckpt.run,
                      interruptions_per_day=interruptions_per_day)


@dataclass(frozen=True)
class ResumeSource:
    """Where a start resumes from: a durable step folder, or the memory tier's newest complete step."""

    tier: str  # "durable" or "memory"
    step: int
    load: Any  # (state dict) -> Sidecar, collective
    where: str  # for the resume event


def find_resume_source(ckpt: CheckpointManager, tier: MemoryTier | None,
                       resume_from: str | None) -> ResumeSource | None:
    """The newest step complete across the tiers: the memory tier's when every shard of it is on some node of
    this launch and it is at least as new as the newest durable checkpoint that verifies, else that one."""
    durable = find_resume(ckpt, resume_from)
    durable_step = ckpt.step_of(durable) if durable is not None else None
    choice = tier.find() if tier is not None else None
    if choice is not None and (durable_step is None or choice.step >= durable_step):
        return ResumeSource("memory", choice.step, lambda state: tier.load(ckpt, choice, state),
                            f"{tier.folder.parent}/<node>/{step_dir_name(choice.step)}")
    if durable is None:
        return None
    return ResumeSource("durable", durable_step, lambda state: ckpt.load(durable, state), str(durable))


def find_resume(ckpt: CheckpointManager, resume_from: str | None) -> Path | None:
    """The newest committed, verified checkpoint of the run (or --resume-from before the run has one); None on a
    fresh start. The same answer on every rank."""
    heartbeat.enter(heartbeat.CHECKPOINT_LOAD)
    if resume_from and not ckpt.has_committed():
        return ckpt.resume_from(resume_from)
    return ckpt.find_resume(ckpt.sidecar["fingerprint"])


def resume(ckpt: CheckpointManager, parts: TrainParts, spec: JobSpec, env: DistEnv, source: ResumeSource | None,
           report: Reporter) -> tuple[BatchStream, dict[str, Any]]:
    """Load ``source`` (find_resume_source's) if there is one; return the data stream and the state every save
    writes.

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
    stream = BatchStream(parts.table, seed=spec.train.seed, shuffle=spec.data.shuffle,
                         micro_batch_size=spec.train.micro_batch_size, grad_accum_steps=grad_accum,
                         dp_rank=env.rank, dp_world=env.world_size, packing=packing_mode(spec.data.packing))
    model_state = ModelOptimState(parts.model, parts.optimizer, trainable_only=spec.model.lora is not None)
    app_state = {"model": model_state, "scheduler": DictState(parts.scheduler),
                 "train": train_state, "data": DictState(stream, optional=BatchStream.ADDED),
                 "rng": RNGState(spec.train.seed, env.rank, env.world_size)}
    if source is not None:
        source.load(app_state)
        report.event(runlog.RESUME, step=state.step, checkpoint=source.where, tier=source.tier,
                     world_size=env.world_size, grad_accum_steps=grad_accum,
                     load_s=round(time.monotonic() - started, 3))
    return stream, app_state


def _export_final(spec: JobSpec, paths: RunPaths, ckpt: CheckpointManager, env: DistEnv, report: Reporter) -> None:
    if spec.checkpoint.export_final and env.is_main:
        from .export.full import export_hf

        shutil.rmtree(paths.export_dir, ignore_errors=True)  # a rerun after an earlier export replaces it
        export_hf(ckpt.latest_committed(), Path(spec.model.path), paths.export_dir, dtype="bf16")
        report.event(runlog.EXPORT, path=str(paths.export_dir))


def _retryable(exc: BaseException) -> bool:
    """Whether a crash may pass on a new attempt: a lost peer or connection, yes; errors of the job itself
    (data, resume refused, out of memory, bugs) or an interrupt, no. The batch script's failure policy
    (orchestrator/supervise/failure.py) also requires that the attempt made progress."""
    if isinstance(exc, (KeyboardInterrupt, MemoryError, torch.OutOfMemoryError)):
        return False
    if isinstance(exc, dist.DistError):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(
        s in text for s in ("connection closed", "connection reset", "broken pipe", "timed out", "nccl", "gloo")
    )


def _log_samples(paths: RunPaths, step: int, micro_batches, env, train_rows: torch.Tensor | None) -> None:
    """Append the global sample ids of this step (all ranks) to samples.jsonl: proves none skipped or repeated.
    With data.eval_fraction, also the rows of the packed data they were (``rows``): proves none was held out."""
    local = [int(i) for mb in micro_batches for i in mb.sample_ids]
    rows = [int(train_rows[i]) for mb in micro_batches for i in mb.sequence_ids] if train_rows is not None else []
    gathered: list = [None] * env.world_size
    dist.all_gather_object(gathered, (local, rows))
    if env.is_main:
        record = {"step": step, "world_size": env.world_size, "ids": sorted(sum((g[0] for g in gathered), []))}
        if train_rows is not None:
            record["rows"] = sorted(sum((g[1] for g in gathered), []))
        with open(paths.run_dir / "samples.jsonl", "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")


def _grad_accum(global_batch: int, micro_batch_size: int, world_size: int) -> int:
    per_step = micro_batch_size * world_size
    if global_batch % per_step:
        raise ValueError(
            f"cannot keep the checkpoint's global batch of {global_batch} sequences on {world_size} ranks with "
            f"micro_batch_size {micro_batch_size}: {global_batch} is not divisible by {per_step}; "
            "pick a world size or micro-batch size that divides it"
        )
    return global_batch // per_step


def _setup_logging(rank: str) -> None:
    logging.basicConfig(
        level=logging.INFO, stream=sys.stdout, force=True,
        format=f"%(asctime)s [rank {rank}] %(name)s %(levelname)s: %(message)s",
    )
