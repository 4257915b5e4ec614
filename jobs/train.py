"""The training worker: set up (build, resume), then one loop that steps, logs and lets the saver save or stop,
then finish (final evaluation, final save, export)."""

from __future__ import annotations

import logging
import math
import os
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from fsdpjob.orchestrator.core import buildid, envvars
from fsdpjob.orchestrator.core.errors import is_peer_error
from fsdpjob.orchestrator.core.jobspec.spec import JobSpec
from fsdpjob.orchestrator.core.runfolder import heartbeat, runlog
from fsdpjob.orchestrator.core.runfolder.paths import RunPaths
from fsdpjob.orchestrator.core.runfolder.runmeta import RunMeta
from fsdpjob.orchestrator.core.runfolder.sidecar import RunFacts

from . import gcpolicy, preemption
from .checkpoint.io import plain_writer
from .checkpoint.manager import CheckpointManager
from .checkpoint.tiers import Tiers, find_resume_source, open_memory_tier
from .data.packing import StepBatch
from .data.stream import BatchStream
from .dist import (
    DistEnv,
    close_distributed,
    control_group,
    export_group,
    host_barrier,
    init_distributed,
    share_from_rank0,
)
from .hooks import StepHooks, TestHooks
from .methods import MethodSetUp, method_row
from .model.lora import checkpoint_fingerprint
from .model.parallelize import build_mesh
from .parts import TrainParts, TrainState, build, resume
from .report.metrics import Reporter, model_flops_per_token
from .savepolicy import Checkpointer
from .step import EvalSchedule, StepValues, loss_chunk_tokens
from .workerenv import WorkerEnv, process_started_at

log = logging.getLogger("fsdpjob.train")


@dataclass
class Launch:
    """This process's launch of the job: what run() has before anything can fail, and what the set-up has opened
    so far (the failure event reads the counters, the clean-up closes the tiers)."""

    paths: RunPaths
    meta: RunMeta
    spec: JobSpec
    stop: preemption.StopFlag
    worker: WorkerEnv
    hooks: TestHooks
    env: DistEnv
    report: Reporter
    tiers: Tiers | None = None
    state: TrainState | None = None


@dataclass
class Training:
    """What the loop trains with (made by _set_up, the same kinds of object on every rank)."""

    parts: TrainParts
    stream: BatchStream
    app_state: dict[str, Any]  # what every save writes
    saver: Checkpointer
    evaluator: EvalSchedule | None
    hooks: StepHooks
    step: Callable[[StepBatch], StepValues]  # the method's optimizer step over this rank's micro-batches
    control: dist.ProcessGroup | None  # host-side agreements, off the GPU stream
    waits_export: dist.ProcessGroup | None  # where the ranks wait for rank 0's export
    defer_grad_sync: bool  # the planner's memory verdict
    start_step: int


def run(run_dir: str, stop: preemption.StopFlag | None = None) -> dict:
    os.umask(0o077)  # run folders hold checkpoints and logs of the user's data: owner only
    launch = _launch(Path(run_dir), stop)
    completed, crashed = False, False
    try:
        training = _set_up(launch)
        _train(launch, training)
        result = _finish(launch, training)
        completed = True
        return result
    except SystemExit:
        raise
    except BaseException as exc:
        crashed = True
        # The step reached counts the steps this crash loses (fsdpjob status: steps lost).
        launch.report.event(runlog.FAILED, all_ranks=True, rank=launch.env.rank,
                            error=f"{type(exc).__name__}: {exc}"[:2000],
                            retryable=_retryable(exc, launch.spec.train.method),
                            step=launch.state.step if launch.state else None)
        raise
    finally:
        gcpolicy.stop()
        if crashed:  # peers may be dead or stuck: abort first, so that nothing below waits on them (or a tracker)
            close_distributed(abort=True)
        if launch.tiers is not None:
            launch.tiers.close(completed=completed, crashed=crashed)
        launch.report.close()  # W&B's finish may take seconds: after the abort on a crash
        if not crashed:
            close_distributed()


def _launch(run_dir: Path, stop: preemption.StopFlag | None) -> Launch:
    """The run's spec, this worker's environment, the process group and the run log's reporter."""
    paths = RunPaths(run_dir)
    meta = RunMeta.read(paths.run_dir)
    spec = JobSpec.model_validate(meta.spec)
    # First thing on every rank: our flag-only handlers replace submitit's (see preemption.py).
    stop = stop or preemption.StopFlag(spec.preemption.signal)
    worker, hooks = WorkerEnv.from_env(), TestHooks.from_env()
    _setup_logging(worker.log_rank)
    heartbeat.enter(heartbeat.PROCESS_GROUP)
    try:
        env = init_distributed(spec.fsdp.collective_timeout_s, cpu_offload=spec.fsdp.cpu_offload, worker=worker)
    except Exception as exc:  # no reporter yet: each failing rank says itself whether a new launch may pass
        rank = int(worker.log_rank) if worker.log_rank.isdigit() else None
        runlog.append(paths.run_dir, runlog.FAILED, rank=rank, phase="rendezvous", step=None, host=worker.host,
                      error=f"{type(exc).__name__}: {exc}"[:2000], retryable=_retryable(exc, spec.train.method))
        raise
    report = Reporter(paths.run_dir, enabled=env.is_main, max_steps=spec.train.max_steps,
                      log_every=spec.train.log_every)
    return Launch(paths, meta, spec, stop, worker, hooks, env, report)


def _set_up(launch: Launch) -> Training:
    """Open the tiers, build, resume from the newest step either tier holds; the saver and the loop's helpers."""
    t_start = time.time()
    if (mismatch := buildid.host_mismatch(envvars.get("FSDPJOB_HOST_BUILD"))) is not None:
        raise BuildMismatch(mismatch)  # not retryable: every restart would run the same image
    spec, env, worker, report, paths = launch.spec, launch.env, launch.worker, launch.report, launch.paths
    torch.manual_seed(spec.train.seed)
    if hooks_on := envvars.test_hooks_set():  # a test switch changes what this run does: said, never silent
        log.warning("test hooks in force: %s", ", ".join(f"{k}={v}" for k, v in hooks_on.items()))
    report.event(runlog.START, restart=worker.restart_count, world_size=env.world_size, job_id=worker.job_id,
                 host=worker.host, launch=worker.launch, process_started_at=process_started_at(),
                 **({"test_hooks": hooks_on} if hooks_on else {}))
    report.open_trackers(spec)  # W&B and MLflow (spec logging) on rank 0; a missing package stops here
    mesh = build_mesh(env, spec.fsdp.replicate_degree)
    tiers = launch.tiers = Tiers(open_checkpoints(spec, launch.meta.checkpoint_root(paths), env, mesh, launch.hooks))
    tiers.memory = open_memory_tier(spec.checkpoint, tiers.durable, job_id=worker.job_id,
                                    restart=worker.restart_count, run_dir=paths.run_dir,
                                    interruptions_per_day=launch.meta.profile.get("expected_interruptions_per_day"))
    source = launch.hooks.in_resume(find_resume_source(tiers, launch.meta.resume_from), launch=worker.launch,
                                    rank=env.rank)
    parts = build(spec, paths, env, report, mesh,
                  # A full fine-tune's checkpoint holds every weight: a resume reads no base weights (at 70B,
                  # minutes of every restart); LoRA's holds the adapters only.
                  read_weights=source is None or spec.model.lora is not None,
                  worker_facts=launch.meta.worker_facts)
    launch.state = parts.state
    control = control_group(env)
    defer_grad_sync = bool(launch.meta.worker_facts.get("defer_grad_sync"))
    chunk_tokens = loss_chunk_tokens(spec.train.method, spec.train.loss, launch.meta.worker_facts,
                                     parts.model.config.to_dict())
    method = method_row(spec.train.method).set_up(MethodSetUp(
        spec, parts, env, report, paths.run_dir, control, chunk_tokens, defer_grad_sync,
        stop_agreed=lambda: _stop_agreed(launch, control),
        hand_off=lambda signum: _hand_off_before_training(launch, signum, control),
        on_chunk=lambda index: launch.hooks.after_reference_chunk(index, launch.stop, env.is_main)))
    stream, app_state = resume(parts, spec, env, source, report, stream_for=method.stream_for)
    tiers.resumed_at(parts.state.step)
    step = method.step()  # a preference method's reference pass runs here, where it is not done yet
    report.event(runlog.READY, step=parts.state.step, setup_s=round(time.time() - t_start, 2))

    # The ranks' wait for rank 0's export, on gloo with the export phase's own bound (not the collectives').
    waits_export = export_group(heartbeat.export_wait_s(spec.recovery.setup_timeout_s, spec.recovery.stall_floor_s)) \
        if spec.checkpoint.export_final and env.world_size > 1 else control
    evaluator = method.evaluator(step) if spec.train.eval_every and parts.eval_table is not None else None
    saver = Checkpointer(tiers, spec.checkpoint, max_steps=spec.train.max_steps, stop=launch.stop, control=control,
                         report=report, hooks=launch.hooks, eval_loss_at=evaluator.loss_at if evaluator else None)
    hooks = launch.hooks.at(rank=env.rank, world_size=env.world_size, run_dir=paths.run_dir,
                            train_rows=parts.train_rows)
    return Training(parts, stream, app_state, saver, evaluator, hooks, step, control, waits_export,
                    defer_grad_sync=defer_grad_sync, start_step=parts.state.step)


def _train(launch: Launch, training: Training) -> None:
    """The loop: each step trains, logs, evaluates when due and lets the saver save or stop."""
    spec, env, report = launch.spec, launch.env, launch.report
    parts, state, saver = training.parts, training.parts.state, training.saver
    report.begin_training(state.step, flops_per_token=_flops_per_token(spec, parts.model, parts.table),
                          device=env.device, world_size=env.world_size)
    gcpolicy.start()  # the collector runs between steps, not inside them
    while state.step < spec.train.max_steps:
        step_started = time.monotonic()
        heartbeat.at_step(state.step, heartbeat.NEXT_BATCH)
        training.hooks.before_step(state.step)
        batch = training.stream.next_step()
        heartbeat.enter(heartbeat.STEP)
        saver.before_step(state.step + 1)  # every few steps, the stop/save flags travel while the step trains
        state.last = training.step(batch)
        lr = parts.scheduler.get_last_lr()[0]
        parts.scheduler.step()
        state.step += 1
        state.tokens_seen += state.last.tokens
        report.on_step(state.step, state.last, lr=lr, tokens_seen=state.tokens_seen)
        training.hooks.after_step(state.step, batch.micro_batches, step_started)
        gcpolicy.after_step(state.step)
        if training.evaluator:
            training.evaluator.maybe_run(state.step)
        if signum := saver.after_step(state.step, training.app_state):
            _hand_off(launch, training, signum)


def _stop_agreed(launch: Launch, control: dist.ProcessGroup | None) -> int:
    """Every rank's stop signal, agreed (the largest): a stop between two chunks of the reference pass."""
    flag = torch.tensor([launch.stop.signum], dtype=torch.int64)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=control)
    return int(flag.item())


def _hand_off_before_training(launch: Launch, signum: int, control: dist.ProcessGroup | None) -> None:
    """A stop before the first step (the reference pass): nothing to save, the pass's chunks are written; every
    rank leaves the way a stop checkpoint's hand-off does, and the next start resumes the pass."""
    preemption.stop_and_hand_off(signum, launch.state.step if launch.state else 0, is_main=launch.env.is_main,
                                 stop=launch.stop, worker=launch.worker,
                                 max_requeues=launch.spec.preemption.max_requeues, save_started=time.time(),
                                 run_dir=launch.paths.run_dir, ending=launch.report.ending,
                                 share=lambda outcome: share_from_rank0(outcome, control))


def _hand_off(launch: Launch, training: Training, signum: int) -> None:
    """The stop's checkpoint is committed: every rank leaves here (SystemExit), the way rank 0 decided; the
    supervisor requeues."""
    preemption.stop_and_hand_off(signum, training.parts.state.step, is_main=launch.env.is_main, stop=launch.stop,
                                 worker=launch.worker, max_requeues=launch.spec.preemption.max_requeues,
                                 save_started=training.saver.save_started, run_dir=launch.paths.run_dir,
                                 ending=launch.report.ending,
                                 share=lambda outcome: share_from_rank0(outcome, training.control))


def _finish(launch: Launch, training: Training) -> dict:
    """After the last step: the final evaluation, the final save, the export; the job's result."""
    spec, env, report, state = launch.spec, launch.env, launch.report, training.parts.state
    heartbeat.at_step(state.step, heartbeat.FINISH)
    if training.evaluator:
        training.evaluator.run_final(state.step, training.start_step)
    training.saver.save_final(state.step, training.app_state)
    heartbeat.enter(heartbeat.EXPORT)
    _export_final(spec, launch.paths, launch.tiers.durable, env, report)
    # The other ranks wait for rank 0's export on gloo, bounded by the export's own bound (export_group), not
    # on NCCL or the default group, whose fsdp.collective_timeout_s a large export can outlast.
    host_barrier(training.waits_export)
    report.event(runlog.DONE, step=state.step, loss=None if math.isnan(state.loss) else state.loss)
    return {"rank": env.rank, "step": state.step, "status": "completed"}


def _flops_per_token(spec: JobSpec, model: torch.nn.Module, table: Any = None) -> float:
    """MFU's FLOPs per real token; the attention term over the contexts the data's tokens attend over (a packed
    table's examples), else the rows' seq_len (preference pairs, prompts)."""
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)  # global sizes (DTensor numel)
    context = table.attention_context() if hasattr(table, "attention_context") else spec.data.seq_len
    return model_flops_per_token(model.config, seq_len=context,
                                 trained_params=trained if spec.model.lora else None)


def open_checkpoints(spec: JobSpec, root: Path, env: DistEnv, mesh: DeviceMesh,
                     hooks: TestHooks) -> CheckpointManager:
    """The durable tier: the production writer (wrapped by the save-pause test hook where it is set)."""
    return CheckpointManager(
        root,
        rank=env.rank, world_size=env.world_size, keep_last=spec.checkpoint.keep_last,
        keep_best=spec.checkpoint.keep_best,
        async_save=spec.checkpoint.async_save, storage_writer=hooks.wrap_writer(plain_writer),
        sidecar=RunFacts(spec_hash=spec.spec_hash(), fingerprint=checkpoint_fingerprint(spec),
                         mesh_shape=tuple(mesh.shape), model_path=spec.model.path),
    )


def _export_final(spec: JobSpec, paths: RunPaths, ckpt: CheckpointManager, env: DistEnv, report: Reporter) -> None:
    if spec.checkpoint.export_final and env.is_main:
        from .export.full import export_hf

        shutil.rmtree(paths.export_dir, ignore_errors=True)  # a rerun after an earlier export replaces it
        export_hf(ckpt.latest_committed(), Path(spec.model.path), paths.export_dir, dtype="bf16")
        report.event(runlog.EXPORT, path=str(paths.export_dir))


class BuildMismatch(RuntimeError):
    """The worker's fsdpjob or submitit is not the batch side's (core/buildid.py)."""


def _retryable(exc: BaseException, method: str) -> bool:
    """Whether a crash may pass on a new attempt: a lost peer or connection, or a fault of the method's own
    machinery its row names (grpo's frozen generation server), yes; errors of the job itself (data, resume
    refused, out of memory, bugs) or an interrupt, no. The batch script's failure policy
    (orchestrator/supervise/failure.py) also requires that the attempt made progress."""
    if isinstance(exc, (KeyboardInterrupt, MemoryError, torch.OutOfMemoryError)):
        return False
    if isinstance(exc, (dist.DistError, *method_row(method).retryable())):
        return True
    # A peer's casualty (core/errors.PEER_ERRORS: timeouts only as the collectives and the store word them), or the
    # communication libraries' own errors; a rank's own "timed out" (a data read, a reward call) is the job's.
    text = str(exc)
    return isinstance(exc, RuntimeError) and (is_peer_error(text) or any(s in text.lower() for s in ("nccl", "gloo")))


def _setup_logging(rank: str) -> None:
    logging.basicConfig(
        level=logging.INFO, stream=sys.stdout, force=True,
        format=f"%(asctime)s [rank {rank}] %(name)s %(levelname)s: %(message)s",
    )
