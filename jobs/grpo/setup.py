"""GRPO's pieces, made once at set-up: the reward functions, the generation and log-probability functions over the
policy, the reference (beta > 0), the rounds stream (made by parts.resume with the checkpoint's global batch) and
the step."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from fsdpjob.orchestrator.core.jobspec.spec import JobSpec

from ..data.packing import StepBatch
from ..data.pairtable import pad_id_of
from ..dist import DistEnv
from ..preference.reference import as_reference
from ..preference.setup import frozen_copy
from .colocate import ColocatedGeneration
from .generate import completion_logps, eos_ids, generate
from .losses import group_advantages
from .rewards import RewardFunctions
from .rounds import GrpoRounds
from .step import GrpoStepValues, grpo_step
from .vllmgen import VllmGeneration


class GrpoTraining:
    """The rounds stream (made by parts.resume for this start's grad-accumulation steps) and the step over it."""

    def __init__(self, make_rounds: Callable[[int], GrpoRounds],
                 train: Callable[[GrpoRounds, StepBatch], GrpoStepValues]):
        self._make_rounds, self._train = make_rounds, train
        self.rounds: GrpoRounds | None = None

    def stream_for(self, grad_accum: int) -> GrpoRounds:
        self.rounds = self._make_rounds(grad_accum)
        return self.rounds

    def step(self, batch: StepBatch) -> GrpoStepValues:
        return self._train(self.rounds, batch)


def grpo_training(spec: JobSpec, parts, env: DistEnv, control: dist.ProcessGroup | None,
                  run_dir: Path) -> GrpoTraining:
    from transformers import AutoTokenizer

    options, table, model = spec.grpo, parts.table, parts.model
    tokenizer = AutoTokenizer.from_pretrained(spec.model.path)
    rewards = RewardFunctions.load(options.reward)
    rewards.check_fields(table.field_names)  # a field only later records have: before the first generation
    # Where a completion ends, as vLLM's (generate.eos_ids): the generation config lists a chat model's
    # end-of-turn token (read from the folder: the worker builds the model from its config alone).
    eos = set(eos_ids(_generation_config(spec.model.path), model.config, tokenizer))
    pad = pad_id_of(tokenizer)
    mbs = spec.train.micro_batch_size

    def logps_of(m: torch.nn.Module, prompt_ids, completion_ids, mask) -> torch.Tensor:
        return completion_logps(m, prompt_ids, completion_ids, mask, env.device, temperature=options.temperature)

    def no_grad_logps(m: torch.nn.Module, prompt_ids, completion_ids, mask) -> torch.Tensor:
        """Micro-batch by micro-batch, as training reads them (the same shapes: the same numbers)."""
        parts_ = [logps_of(m, prompt_ids[at:at + mbs], completion_ids[at:at + mbs], mask[at:at + mbs])
                  for at in range(0, len(prompt_ids), mbs)]
        return torch.cat(parts_)

    def gen(prompt_ids, generator):
        return generate(model, prompt_ids, max_new_tokens=options.max_new_tokens, temperature=options.temperature,
                        top_p=options.top_p, generator=generator, eos_token_ids=eos, pad_id=pad, device=env.device)

    before_round = after_round = None
    round_group = control
    if options.generator.colocated:  # this rank's own vLLM engine generates; the policy goes to it in memory
        engine = ColocatedGeneration(spec, model, env, run_dir, pad, control)
        gen, before_round, after_round = engine.generate, engine.before_round, engine.after_round
    elif options.generator.server:  # the supervisor's vLLM server generates; the policy goes to it
        remote = VllmGeneration(spec, model, env, run_dir, pad, control)
        gen, before_round, round_group = remote.generate, remote.before_round, remote.wait_group

    def score(rows: list[int], completion_ids: torch.Tensor, mask: torch.Tensor):
        texts = [tokenizer.decode(ids[:int(m.sum())].tolist(), skip_special_tokens=True)
                 for ids, m in zip(completion_ids, mask)]
        return rewards.score([table.prompts[i] for i in rows], texts, [table.fields[i] for i in rows], rows=rows,
                             places=table.places)

    def old_logps(prompt_ids, completion_ids, mask) -> torch.Tensor:
        with torch.no_grad():
            return no_grad_logps(model, prompt_ids, completion_ids, mask)

    def stream_for(grad_accum: int) -> GrpoRounds:
        return GrpoRounds(
            table, seed=spec.train.seed, shuffle=spec.data.shuffle, num_generations=options.num_generations,
            steps_per_generation=options.steps_per_generation, per_rank=mbs * grad_accum, micro_batch_size=mbs,
            rank=env.rank, world_size=env.world_size, device=env.device, generate=gen, score=score,
            advantages=lambda r: group_advantages(r, options.num_generations, options.scale_rewards),
            # One step per round: the ratio is 1 and its gradient the policy's own (TRL: logps.detach()).
            old_logps=old_logps if options.steps_per_generation > 1 else None,
            control=round_group, step_of=lambda: parts.state.step, before_round=before_round, after_round=after_round,
            end_ids=frozenset(eos | {pad}), scale_rewards=options.scale_rewards)

    reference_of = _reference(spec, parts, env, logps_of)

    def train_logps_of(m: torch.nn.Module, prompt_ids, completion_ids, mask) -> tuple[torch.Tensor, torch.Tensor]:
        return completion_logps(m, prompt_ids, completion_ids, mask, env.device, temperature=options.temperature,
                                entropy=True)

    def step(rounds: GrpoRounds, batch: StepBatch) -> GrpoStepValues:
        return grpo_step(model, parts.optimizer, batch.micro_batches, rounds.last, logps_of=train_logps_of,
                         reference_of=reference_of, options=options, max_grad_norm=spec.train.max_grad_norm,
                         timings=rounds.take_timings)

    return GrpoTraining(stream_for, step)


def _reference(spec: JobSpec, parts, env: DistEnv, logps_of) -> Callable:
    """beta > 0: the starting model's log-probabilities of each micro-batch (LoRA: the base with the adapters off;
    a full fine-tune: a frozen sharded copy). beta 0: none, no second model (TRL's default)."""
    if spec.grpo.beta == 0:
        return lambda _batch: None
    lora = spec.model.lora is not None
    model = parts.model if lora else frozen_copy(spec, env, parts.mesh, parts.separate_root)

    def reference(batch) -> torch.Tensor:
        with as_reference(model, lora):
            return logps_of(model, batch.prompt_ids, batch.completion_ids, batch.mask)
    return reference


def _generation_config(model_path: str):
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(model_path)
    except OSError:  # no generation_config.json
        return None
