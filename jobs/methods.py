"""The worker's table of training methods (``train.method``), one ``MethodRow`` each, the way
core/jobspec/methods.py's ``METHODS`` is the login side's (which the worker reads too: the data shape, the
reference, whether the chunked loss applies). A row says what the set-up runs for its method:

- ``read_data``: the training table, the eval table (or None) and the held-out rows' places (jobs/sft/data.py,
  jobs/preference/data.py, jobs/grpo/prompts.py);
- ``head``: load_model's head arguments (a reward model's scalar head), none for a causal LM;
- ``set_up``: the method's training over the built parts: its step (and reference), its evaluator, a data stream
  of its own (grpo's rounds), as ``MethodTraining``;
- ``retryable``: the exceptions of the method's own machinery that a new attempt may pass (grpo's silent
  generation server), beside the lost peers jobs/train.py knows.

jobs/train.py and jobs/parts.py look the row up; nothing else of the worker asks which method it trains. The
method packages (jobs/sft/, jobs/preference/, jobs/grpo/) do not import this table; grpo's pieces are imported
for grpo runs only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

from fsdpjob.orchestrator.core.jobspec.spec import JobSpec
from fsdpjob.orchestrator.core.runfolder.paths import RunPaths

from .data.packing import StepBatch
from .data.preference import read_pair_table, read_unpaired_table
from .dist import DistEnv
from .preference.batches import orpo_logps, policy_logps, reward_scores
from .preference.data import read_preference_data
from .preference.objective import dpo_objective, kto_objective, orpo_objective, reward_objective
from .preference.setup import preference_step_function, score_head
from .report.metrics import Reporter
from .sft.data import read_sft_data
from .sft.step import sft_evaluator, sft_step
from .step import EvalSchedule, StepValues

StepFunction = Callable[[StepBatch], StepValues]
ReadData = Callable[[JobSpec, RunPaths, DistEnv, Reporter, Any], tuple[Any, Any, Any]]


@dataclass
class MethodSetUp:
    """What a method's set-up reads, made once by jobs/train.py's _set_up."""

    spec: JobSpec
    parts: Any  # parts.TrainParts, built and not resumed yet
    env: DistEnv
    report: Reporter
    run_dir: Path
    control: dist.ProcessGroup | None  # host-side agreements
    chunk_tokens: int  # train.loss's chunk as the SFT step runs it (step.loss_chunk_tokens)
    defer_grad_sync: bool  # the planner's memory verdict
    stop_agreed: Callable[[], int]  # every rank's stop signal, agreed (a stop during a reference pass)
    hand_off: Callable[[int], None]  # leave before the first step, the way a stop checkpoint's hand-off does
    on_chunk: Callable[[int], None]  # the test hook after each chunk of a reference pass


@dataclass
class MethodTraining:
    """A method's training as the loop uses it: ``step()`` after resume (a reference pass runs there, after the
    counters are loaded), ``evaluator(step)`` where the run evaluates, ``stream_for`` for a stream of its own."""

    step: Callable[[], StepFunction]
    evaluator: Callable[[StepFunction], EvalSchedule | None]
    stream_for: Callable[[int], Any] | None = None  # parts.resume's stream for this start's grad-accumulation


def _no_head(_spec: JobSpec) -> dict[str, Any]:
    return {}


def _none() -> tuple[type[BaseException], ...]:
    return ()


@dataclass(frozen=True)
class MethodRow:
    """What the worker runs for one method."""

    read_data: ReadData
    set_up: Callable[[MethodSetUp], MethodTraining]
    head: Callable[[JobSpec], dict[str, Any]] = _no_head
    retryable: Callable[[], tuple[type[BaseException], ...]] = _none


# -- sft

def _sft(s: MethodSetUp) -> MethodTraining:
    return MethodTraining(
        step=lambda: sft_step(s.spec, s.parts, s.env, defer_grad_sync=s.defer_grad_sync, chunk_tokens=s.chunk_tokens),
        evaluator=lambda _step: sft_evaluator(s.spec, s.parts, s.env, s.report, s.chunk_tokens))


# -- the preference methods: one set-up, each with its objective and forward (log-probabilities or scores)

def _preference(objective_of, forward) -> Callable[[MethodSetUp], MethodTraining]:
    def set_up(s: MethodSetUp) -> MethodTraining:
        def step() -> StepFunction:
            return preference_step_function(s.spec, s.parts, s.env, s.run_dir, s.report, objective_of=objective_of,
                                            forward=forward, stop_agreed=s.stop_agreed, hand_off=s.hand_off,
                                            on_chunk=s.on_chunk)
        # its own loss and metrics over the eval rows, with its reference (preference/evaluate.py)
        return MethodTraining(step, evaluator=lambda made: made.evaluator(s.spec.train.eval_every, s.report))
    return set_up


def _pairs(spec: JobSpec, _paths: RunPaths, _env: DistEnv, report: Reporter, tokenizer) -> tuple[Any, Any, Any]:
    return read_preference_data(spec, tokenizer, report, read=read_pair_table)


def _scored_pairs(spec: JobSpec, _paths: RunPaths, _env: DistEnv, report: Reporter,
                  tokenizer) -> tuple[Any, Any, Any]:
    options = {"margin_field": spec.reward.margin_field} if spec.reward else {}  # each pair's margin, if named
    return read_preference_data(spec, tokenizer, report, read=read_pair_table, options=options)


def _labelled_answers(spec: JobSpec, _paths: RunPaths, _env: DistEnv, report: Reporter,
                      tokenizer) -> tuple[Any, Any, Any]:
    return read_preference_data(spec, tokenizer, report, read=read_unpaired_table, kl_partners=True)


# -- grpo: its generation, rewards and losses are imported for grpo runs only

def _prompts(spec: JobSpec, _paths: RunPaths, _env: DistEnv, report: Reporter, tokenizer) -> tuple[Any, Any, Any]:
    from .grpo.prompts import read_prompt_data

    return read_prompt_data(spec, tokenizer, report)


def _grpo(s: MethodSetUp) -> MethodTraining:
    from .grpo.setup import grpo_training

    grpo = grpo_training(s.spec, s.parts, s.env, s.control, s.run_dir)
    return MethodTraining(step=lambda: grpo.step, evaluator=lambda _step: None, stream_for=grpo.stream_for)


def _grpo_retryable() -> tuple[type[BaseException], ...]:
    from fsdpjob.orchestrator.core.genserver.client import ServerUnresponsive

    return (ServerUnresponsive,)  # the generation server went silent: the supervisor restarts it


# One row per method of core/jobspec/methods.py's METHODS.
METHODS: dict[str, MethodRow] = {
    "sft": MethodRow(read_sft_data, _sft),
    "dpo": MethodRow(_pairs, _preference(dpo_objective, policy_logps)),
    "orpo": MethodRow(_pairs, _preference(orpo_objective, orpo_logps)),
    "kto": MethodRow(_labelled_answers, _preference(kto_objective, policy_logps)),
    "reward": MethodRow(_scored_pairs, _preference(reward_objective, reward_scores), head=score_head),
    "grpo": MethodRow(_prompts, _grpo, retryable=_grpo_retryable),
}


def method_row(method: str) -> MethodRow:
    """``method``'s row (the spec admits only the names both tables hold)."""
    return METHODS[method]
