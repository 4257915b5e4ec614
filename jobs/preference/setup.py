"""A preference method's step, made once at set-up: its objective, and its reference (the cache, filled by the
reference pass before the first step where it is not complete yet, or a live model)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import torch

from fsdpjob.orchestrator.core.jobspec.methods import facts_of
from fsdpjob.orchestrator.core.jobspec.spec import JobSpec
from fsdpjob.orchestrator.core.runfolder import runlog
from fsdpjob.orchestrator.core.runfolder.runmeta import RunMeta

from ..data.packing import StepBatch
from ..data.pairtable import pad_id_of
from ..dist import DistEnv
from ..model.build import load_model
from ..model.checkpointing import NONE
from ..report.metrics import Reporter
from .evaluate import PreferenceEvaluator
from .objective import Objective, RankMean
from .reference import ReferenceCache, as_reference, cache_dir, compute_reference, reference_logps
from .refsource import adopt, cache_of_source
from .step import Forward, preference_step, rank_mean


class PreferenceTraining:
    """A preference method's step (callable on a StepBatch) and, with eval data, its evaluator."""

    def __init__(self, step: Callable[[StepBatch], object], evaluator: Callable[[int, Reporter], object] | None):
        self._step, self.evaluator = step, evaluator

    def __call__(self, batch: StepBatch):
        return self._step(batch)


def preference_step_function(spec: JobSpec, parts, env: DistEnv, run_dir: Path, report: Reporter, *,
                             objective_of: Callable[[object, RankMean], Objective], forward: Forward,
                             stop_agreed: Callable[[], int], hand_off: Callable[[int], None],
                             on_chunk: Callable[[int], None] | None = None) -> PreferenceTraining:
    """The method's step with ``objective_of``'s objective (its options, the ranks' mean) over ``forward``'s
    log-probabilities (or scores), and its reference where the method has one (core/jobspec/methods.py)."""
    objective = objective_of(spec.method_options, rank_mean)
    reference = facts_of(spec.train.method).reference is not None
    reference_of = _reference(spec, parts, parts.table, env, run_dir, report, stop_agreed, hand_off, on_chunk) \
        if reference else (lambda _batch: None)
    # The eval rows' reference too, before training: a pass of their own where cached; live, the same model.
    eval_reference = reference_of
    if reference and parts.eval_table is not None and spec.method_options.reference == "cached":
        eval_reference = _reference(spec, parts, parts.eval_table, env, run_dir, report, stop_agreed, hand_off,
                                    on_chunk, what="eval")

    def step(batch: StepBatch):
        return preference_step(parts.model, parts.optimizer, batch.micro_batches, env.device, objective=objective,
                               # The global batch the run keeps on any world size (a resume on fewer ranks
                               # accumulates more micro-batches), not this start's spec product.
                               reference_of=reference_of, pairs=parts.state.global_batch, tokens=batch.tokens,
                               max_grad_norm=spec.train.max_grad_norm, processed=batch.processed,
                               forward=forward)

    def evaluator(eval_every: int, evaluated: Reporter) -> PreferenceEvaluator:
        return PreferenceEvaluator(parts.model, parts.eval_table, objective=objective, reference_of=eval_reference,
                                   forward=forward, eval_every=eval_every, max_batches=spec.train.eval_batches,
                                   micro_batch_size=spec.train.micro_batch_size, rank=env.rank,
                                   world_size=env.world_size, device=env.device, report=evaluated,
                                   as_eval=lambda model: as_reference(model, False))
    return PreferenceTraining(step, evaluator if parts.eval_table is not None else None)


def score_head(spec: JobSpec) -> dict:
    """A reward model's scalar head (load_model's arguments), which scores a row at its last token that is not the
    data's pad id."""
    from transformers import AutoTokenizer

    return {"head": "score", "pad_token_id": pad_id_of(AutoTokenizer.from_pretrained(spec.model.path))}


def _reference(spec: JobSpec, parts, table, env: DistEnv, run_dir: Path, report: Reporter,
               stop_agreed: Callable[[], int], hand_off: Callable[[int], None], on_chunk, what: str = "train"):
    lora = spec.model.lora is not None
    # Two columns for a pair table (chosen, rejected) and for kto's (the answer, its KL row: ktobatch.py).
    width = 2 if hasattr(table, "chosen_ids") or hasattr(table, "partners") else 1
    if spec.method_options.reference == "live":
        model = parts.model if lora else frozen_copy(spec, env, parts.mesh, parts.separate_root)

        def live(batch) -> torch.Tensor:
            with as_reference(model, lora):
                return reference_logps(model, batch, env.device, width)
        return live
    cache = ReferenceCache(cache_dir(run_dir, table.fingerprint(), _model_key(spec)), len(table), width)
    if cache.complete:
        cache.load_written()
    elif parts.state.step == 0 or lora:  # the weights it starts from: the model now (LoRA: its adapters off)
        _run_pass(spec, parts.model, table, env, cache, report, lora, stop_agreed, hand_off, on_chunk, what)
    elif (found := cache_of_source(cache, run_dir, RunMeta.read(run_dir).resume_from)) is not None:
        adopt(cache, found, env.is_main)
    else:
        # Past step 0 the model is trained: the pass runs on a fresh copy of the starting weights (model.path;
        # resume refuses another), held for the pass only.
        starting = frozen_copy(spec, env, parts.mesh, parts.separate_root)
        _run_pass(spec, starting, table, env, cache, report, False, stop_agreed, hand_off, on_chunk, what,
                  weights="model.path")
        del starting
    return lambda batch: cache.lookup(batch.rows)


def _run_pass(spec, model, table, env, cache, report, lora, stop_agreed, hand_off, on_chunk, what,
              weights: str | None = None) -> None:
    started = time.time()
    named = {"table": what} if what != "train" else {}  # the eval rows' pass says so; the training rows' as before
    named |= {"weights": weights} if weights else {}  # a pass on a fresh copy of the starting weights says so
    report.event(runlog.REFERENCE, phase="start", rows=cache.rows, folder=str(cache.folder), **named)
    signum = compute_reference(model, table, cache, lora=lora, device=env.device,
                               micro_batch_size=spec.train.micro_batch_size, rank=env.rank,
                               world_size=env.world_size, is_main=env.is_main, stop_agreed=stop_agreed,
                               on_chunk=on_chunk)
    seconds = round(time.time() - started, 3)
    if signum:
        report.event(runlog.REFERENCE, phase="stopped", seconds=seconds, **named)
        hand_off(signum)
    report.event(runlog.REFERENCE, phase="done", seconds=seconds, rows=cache.rows, **named)


def _model_key(spec: JobSpec) -> str:
    """What makes the reference: the model the run starts from (with LoRA, the base), its dtype and precision."""
    base = f"{'lora' if spec.model.lora else 'full'}{':' + spec.model.quantize if spec.model.quantize else ''}"
    return f"{spec.model.path}:{spec.model.dtype}:{spec.fsdp.mixed_precision}:{base}"


def frozen_copy(spec: JobSpec, env: DistEnv, mesh, separate_root: bool) -> torch.nn.Module:
    """``reference: live`` on a full fine-tune: a second sharded copy of the starting weights, never trained: no
    activation checkpointing (it runs no backward), its embedding and head sharded like the policy's."""
    model = load_model(spec.model.path, env=env, mesh=mesh, dtype=getattr(torch, spec.model.dtype),
                       attn_implementation=spec.model.attn_implementation, mixed_precision=spec.fsdp.mixed_precision,
                       reshard_after_forward=spec.fsdp.reshard_after_forward, activation_checkpointing=NONE,
                       cpu_offload=spec.fsdp.cpu_offload, compile_layers=False, lora=None, read_weights=True,
                       packed=False, separate_root=separate_root)
    for p in model.parameters():
        p.requires_grad_(False)
    return model.eval()
