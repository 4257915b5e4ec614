"""The training worker: one loop that reads top to bottom (setup, resume, step/log/save/stop, final save)."""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from fsdpjob.orchestrator import __version__

from fsdpjob.orchestrator.slurm import commands as slurm_cli
from fsdpjob.orchestrator.core.paths import RunPaths
from fsdpjob.orchestrator.core.spec import JobSpec

from . import preemption
from .checkpoint import CheckpointManager
from .ckpt_state import DictState, ModelOptimState, RNGState
from .data import BatchStream, build_sequences, count_tokens, read_examples
from .datacache import load_or_build
from .dist import close_distributed, init_distributed
from .metrics import Reporter, peak_memory_mb
from .model import load_model, model_flops_per_token
from .parallelize import build_mesh
from .schedule import lr_factor

log = logging.getLogger("fsdpjob.train")


@dataclass
class TrainState:
    """Training counters saved with every checkpoint."""

    step: int = 0
    tokens_seen: int = 0
    global_batch: int = 0
    # The last trained step's loss: a start that resumes from the final checkpoint trains no step
    # and still reports it. NaN before the first step (DCP keeps a float; None would need pickling).
    loss: float = float("nan")
    # Keys added after checkpoints were already written (absent from older ones; see DictState).
    ADDED = ("loss",)

    def state_dict(self) -> dict:
        return {"step": self.step, "tokens_seen": self.tokens_seen, "global_batch": self.global_batch,
                "loss": self.loss}

    def load_state_dict(self, state: dict) -> None:
        self.step, self.tokens_seen = int(state["step"]), int(state["tokens_seen"])
        self.global_batch, self.loss = int(state["global_batch"]), float(state.get("loss", float("nan")))


def run(run_dir: str, stop: preemption.StopFlag | None = None) -> dict:
    os.umask(0o077)  # run folders hold checkpoints and logs of the user's data: owner only
    paths = RunPaths(Path(run_dir))
    meta = json.loads(paths.spec_file.read_text(encoding="utf-8"))
    spec = JobSpec.model_validate(meta["spec"])
    # First thing on every rank: our flag-only handlers replace submitit's (see preemption.py).
    stop = stop or preemption.StopFlag(spec.preemption.signal)
    _setup_logging()
    env = init_distributed(spec.fsdp.collective_timeout_s, cpu_offload=spec.fsdp.cpu_offload)
    report = Reporter(paths.run_dir, enabled=env.is_main, max_steps=spec.train.max_steps)
    ckpt, state = None, None
    try:
        t_start = time.time()
        torch.manual_seed(spec.train.seed)
        report.event("start", restart=slurm_cli.restart_count(), world_size=env.world_size,
                     job_id=os.environ.get("SLURM_JOB_ID") or os.environ.get("SUBMITIT_LOCAL_JOB_ID"),
                     host=os.uname().nodename)

        # Model: meta init on every rank, FSDP2 wrap, weights read on rank 0 and broadcast.
        mesh = build_mesh(env, spec.fsdp.replicate_degree)
        model = load_model(
            spec.model.path, env=env, mesh=mesh, dtype=getattr(torch, spec.model.dtype),
            attn_implementation=spec.model.attn_implementation, mixed_precision=spec.fsdp.mixed_precision,
            reshard_after_forward=spec.fsdp.reshard_after_forward,
            activation_checkpointing=spec.model.activation_checkpointing, cpu_offload=spec.fsdp.cpu_offload,
        )
        model.train()
        # Fused on CUDA: foreach AdamW holds one more shard-sized temporary (the planner assumes fused).
        optimizer = torch.optim.AdamW(
            model.parameters(), lr=spec.train.lr, betas=spec.train.betas, weight_decay=spec.train.weight_decay,
            fused=env.device.type == "cuda" or None,
        )
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(
            s, max_steps=spec.train.max_steps, warmup_steps=spec.train.warmup_steps,
            schedule=spec.train.lr_schedule, min_lr_ratio=spec.train.min_lr_ratio))

        # Data: tokenized and packed the same way on every rank; each rank reads its own slice.
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(spec.model.path)
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        t_data = time.time()
        table, cached = load_or_build(
            spec.data, spec.model.path, pad_id, paths.cache_dir, is_main=env.is_main,
            build=lambda: build_sequences(read_examples(spec.data, tokenizer), spec.data.seq_len,
                                          spec.data.packing, pad_id))
        report.event("data", sequences=len(table), examples=table.num_examples, truncated=table.truncated,
                     cached=cached, seconds=round(time.time() - t_data, 2))

        # Resume: newest committed, verified checkpoint (or --resume-from); keeps the global batch.
        state = TrainState(global_batch=spec.train.micro_batch_size * spec.train.grad_accum_steps * env.world_size)
        ckpt = CheckpointManager(
            Path(spec.checkpoint.dir) if spec.checkpoint.dir else paths.checkpoints_dir,
            rank=env.rank, world_size=env.world_size, keep_last=spec.checkpoint.keep_last,
            async_save=spec.checkpoint.async_save,
            sidecar={"spec_hash": spec.spec_hash(), "fingerprint": spec.model_fingerprint(),
                     "world_size": env.world_size, "mesh_shape": list(mesh.shape), "fsdpjob_version": __version__,
                     "model_path": spec.model.path},
        )
        resume_dir = (ckpt.resume_from(meta["resume_from"]) if meta.get("resume_from") and not ckpt.has_committed()
                      else ckpt.find_resume(spec.model_fingerprint()))
        train_state = DictState(state, optional=TrainState.ADDED)
        if resume_dir is not None:
            ckpt.load(resume_dir, {"train": train_state})  # its global batch sizes the data stream below
        grad_accum = _grad_accum(state.global_batch, spec.train.micro_batch_size, env.world_size)
        stream = BatchStream(table, seed=spec.train.seed, shuffle=spec.data.shuffle,
                             micro_batch_size=spec.train.micro_batch_size, grad_accum_steps=grad_accum,
                             dp_rank=env.rank, dp_world=env.world_size)
        app_state = {"model": ModelOptimState(model, optimizer), "scheduler": DictState(scheduler),
                     "train": train_state, "data": DictState(stream),
                     "rng": RNGState(spec.train.seed, env.rank, env.world_size)}
        if resume_dir is not None:
            ckpt.load(resume_dir, app_state)
            report.event("resume", step=state.step, checkpoint=str(resume_dir), world_size=env.world_size,
                         grad_accum_steps=grad_accum)
        report.event("ready", step=state.step, setup_s=round(time.time() - t_start, 2))

        flops_per_token = model_flops_per_token(model.config, seq_len=spec.data.seq_len)
        last_save, last_log, tokens_since_log, logged_step = time.time(), time.time(), 0, state.step
        stop_at = int(os.environ.get("FSDPJOB_STOP_AT_STEP", "0") or 0)  # test hook: a stop request at a step
        log_samples = bool(os.environ.get("FSDPJOB_LOG_SAMPLES"))  # test hook: global sample ids per step
        while state.step < spec.train.max_steps:
            micro_batches = stream.next_step()
            state.loss, tokens, grad_norm = train_step(model, optimizer, micro_batches, env.device,
                                                       max_grad_norm=spec.train.max_grad_norm)
            if log_samples:
                _log_samples(paths, state.step + 1, micro_batches, env)
            lr = scheduler.get_last_lr()[0]
            scheduler.step()
            state.step += 1
            state.tokens_seen += tokens
            tokens_since_log += tokens

            if state.step % spec.train.log_every == 0 or state.step in (1, spec.train.max_steps):
                now = time.time()
                elapsed, steps_in_window = now - last_log, max(1, state.step - logged_step)
                report.step(state.step, {
                    "loss": state.loss, "lr": lr, "grad_norm": grad_norm, "tokens": state.tokens_seen,
                    "tokens_per_s": tokens_since_log / max(elapsed, 1e-9),
                    "mfu": _mfu(flops_per_token, tokens_since_log, elapsed, env),
                    "peak_mem_mb": peak_memory_mb(env.device),
                }, step_time_s=elapsed / steps_in_window)
                last_log, tokens_since_log, logged_step = now, 0, state.step

            if stop_at and state.step == stop_at and env.is_main:
                stop.request()
            signum, time_due = _decide(stop, env.device, spec, last_save)
            if signum and state.step >= spec.train.max_steps:
                # The last step is trained: the final save below ends the job sooner than a requeue would.
                log.info("stop signal %d after the last step: finishing instead of requeueing", signum)
            elif signum or time_due or _interval_due(spec, state.step):
                why = "stop" if signum else "interval"
                t0 = time.time()
                ckpt.save(state.step, app_state, reason=why)
                last_save = time.time()
                if signum:
                    ckpt.wait()  # committed on every rank before anyone requeues
                    _stop_and_requeue(stop, signum, spec, state, report, t0, env.device)
        ckpt.save(state.step, app_state, reason="final")
        ckpt.wait()
        if spec.checkpoint.export_final and env.is_main:
            from .export import export_hf

            shutil.rmtree(paths.export_dir, ignore_errors=True)  # a rerun after an earlier export replaces it
            export_hf(ckpt.latest_committed(), Path(spec.model.path), paths.export_dir, dtype="bf16")
            report.event("export", path=str(paths.export_dir))
        dist.barrier()
        report.event("done", step=state.step, loss=None if math.isnan(state.loss) else state.loss)
        return {"rank": env.rank, "step": state.step, "status": "completed"}
    except SystemExit:
        raise
    except BaseException as exc:
        # The step reached counts the steps this crash loses (fsdpjob status: steps lost).
        report.event("failed", all_ranks=True, rank=env.rank, error=f"{type(exc).__name__}: {exc}"[:2000],
                     retryable=_retryable(exc), step=state.step if state else None)
        raise
    finally:
        if ckpt is not None:
            ckpt.close()
        report.close()
        close_distributed()


def train_step(model, optimizer, micro_batches, device: torch.device, *, max_grad_norm: float) -> tuple[float, int, float]:
    """One optimizer step over this rank's micro-batches.

    The loss is the mean over real (unmasked) target tokens of the whole global batch, across
    micro-batches and ranks: each micro-batch's summed token loss is divided by the global token count.
    FSDP averages gradients over ranks, so the local loss is scaled by the world size to undo that mean.
    """
    world = dist.get_world_size()
    local_tokens = sum(count_tokens(mb.labels) for mb in micro_batches)
    global_tokens = torch.tensor([local_tokens], dtype=torch.float64, device=device)
    dist.all_reduce(global_tokens)
    denom = max(global_tokens.item(), 1.0)
    loss_sum = torch.zeros((), dtype=torch.float32, device=device)
    for mb in micro_batches:
        input_ids, labels = mb.input_ids.to(device), mb.labels.to(device)
        logits = model(input_ids=input_ids, use_cache=False).logits
        # Shift the labels, not the logits: slicing the (batch, seq, vocab) logits would copy them.
        targets = F.pad(labels[:, 1:], (0, 1), value=-100)
        token_loss = F.cross_entropy(
            logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1), ignore_index=-100, reduction="sum"
        )
        (token_loss * (world / denom)).backward()
        loss_sum += token_loss.detach()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm if max_grad_norm > 0 else float("inf"))
    norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    dist.all_reduce(loss_sum)
    return loss_sum.item() / denom, int(global_tokens.item()), float(norm)


def _decide(stop: preemption.StopFlag, device: torch.device, spec: JobSpec, last_save: float) -> tuple[int, bool]:
    """One collective per step: any rank's stop signal, and rank 0's clock for time-based saves."""
    minutes = spec.checkpoint.interval_minutes
    due = int(bool(minutes) and dist.get_rank() == 0 and time.time() - last_save >= minutes * 60)
    flags = torch.tensor([stop.signum, due], dtype=torch.int64, device=device)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    return int(flags[0]), bool(flags[1])


def _interval_due(spec: JobSpec, step: int) -> bool:
    n = spec.checkpoint.interval_steps
    return bool(n) and step % n == 0 and step < spec.train.max_steps


def _stop_and_requeue(stop, signum, spec, state, report, t_save_start, device) -> None:
    """After a committed stop checkpoint: one rank requeues (unless the job was cancelled), every rank
    leaves without a result."""
    outcome = preemption.REQUEUED
    if dist.get_rank() == 0:
        kind = preemption.classify_stop(signum)
        signal_to_commit = time.time() - (stop.received_at or t_save_start)
        outcome, detail = preemption.requeue(spec.preemption.max_requeues, slurm_cli.restart_count())
        kind = "cancelled" if outcome == preemption.CANCELLED else kind
        report.event("stop", reason=kind, signal=signum, step=state.step, requeued=outcome == preemption.REQUEUED,
                     detail=detail, save_s=round(time.time() - t_save_start, 3),
                     signal_to_commit_s=round(signal_to_commit, 3))
        if outcome == preemption.NOT_REQUEUED:
            report.event("failed", reason=detail, step=state.step, retryable=False)
    flag = torch.tensor([outcome], dtype=torch.int32, device=device)
    dist.broadcast(flag, src=0)  # every rank exits the same way
    preemption.exit_after_stop(int(flag.item()))


def _retryable(exc: BaseException) -> bool:
    """Whether a crash may pass on a new attempt: a lost peer or connection, yes; errors of the job itself
    (data, resume refused, out of memory, bugs) or an interrupt, no. The batch script's failure policy
    (orchestrator/failure.py) also requires that the attempt made progress."""
    if isinstance(exc, (KeyboardInterrupt, MemoryError, torch.OutOfMemoryError)):
        return False
    if isinstance(exc, dist.DistError):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(
        s in text for s in ("connection closed", "connection reset", "broken pipe", "timed out", "nccl", "gloo")
    )


def _log_samples(paths: RunPaths, step: int, micro_batches, env) -> None:
    """Append the global sample ids of this step (all ranks) to samples.jsonl: proves none skipped or repeated."""
    local = [int(i) for mb in micro_batches for i in mb.sample_ids]
    gathered: list = [None] * env.world_size
    dist.all_gather_object(gathered, local)
    if env.is_main:
        with open(paths.run_dir / "samples.jsonl", "a", encoding="utf-8") as f:
            f.write(json.dumps({"step": step, "world_size": env.world_size, "ids": sorted(sum(gathered, []))}) + "\n")


def _grad_accum(global_batch: int, micro_batch_size: int, world_size: int) -> int:
    per_step = micro_batch_size * world_size
    if global_batch % per_step:
        raise ValueError(
            f"cannot keep the checkpoint's global batch of {global_batch} sequences on {world_size} ranks with "
            f"micro_batch_size {micro_batch_size}: {global_batch} is not divisible by {per_step}; "
            "pick a world size or micro-batch size that divides it"
        )
    return global_batch // per_step


def _mfu(flops_per_token: float, tokens: int, seconds: float, env) -> float:
    """Model FLOP utilisation on CUDA (bf16 dense peak of the device), 0 on CPU where no peak is defined."""
    if env.device.type != "cuda" or seconds <= 0:
        return 0.0
    from .model import device_peak_flops

    return flops_per_token * tokens / seconds / (device_peak_flops(env.device) * env.world_size)


def _setup_logging() -> None:
    rank = os.environ.get("SLURM_PROCID") or os.environ.get("SUBMITIT_LOCAL_GLOBALID") or os.environ.get("RANK", "0")
    logging.basicConfig(
        level=logging.INFO, stream=sys.stdout, force=True,
        format=f"%(asctime)s [rank {rank}] %(name)s %(levelname)s: %(message)s",
    )
