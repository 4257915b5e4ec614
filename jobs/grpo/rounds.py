"""GRPO's data: rounds of generations. A round takes the prompts of ``steps_per_generation`` steps from a resumable
prompt stream, generates ``num_generations`` completions per prompt on every rank with the policy as it is at the
round's first step, scores them, and keeps the whole round (every rank's completions, in one global order) until
its steps have trained on it.

Why the round is global: the group statistics (and TRL's batch scaling) are over every rank's rewards, the loss's
normaliser (dapo) is the step's global token count, and a checkpoint written in the middle of a round must hold the
generations not yet trained on (they came from a policy the run no longer has): one all-gather per round on the
host group gives all three, and every rank saves the same bytes (DCP keeps one copy). Sampling draws from a generator
seeded by (seed, the round's first step, rank): a resumed run generates what the uninterrupted one did.

Global order of a round's completions: step k of the round, then rank r, then the rank's rows; a prompt's group is
``num_generations`` consecutive rows on one rank. A resume on another world size re-slices each step's block, which
keeps the groups whole because ``num_generations`` divides every rank's share (spec check_grpo).
"""

from __future__ import annotations

import io
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from fsdpjob.orchestrator.core.runfolder import heartbeat

from ..checkpoint.state import derived_seed
from ..data.packing import StepBatch
from ..data.stream import BatchStream
from .losses import nanstd


@dataclass
class Round:
    """One round's completions in global order (identical on every rank)."""

    start_step: int  # the optimizer step the round's generations were made before (its policy version)
    rows: torch.Tensor  # [R] the prompt table's row of each completion
    completion_ids: torch.Tensor  # [R, T] padded after the end
    mask: torch.Tensor  # [R, T] the completion's tokens (EOS included)
    rewards: torch.Tensor  # [R] the weighted sum
    per_function: torch.Tensor  # [F, R]
    advantages: torch.Tensor  # [R]
    old_logps: torch.Tensor | None  # [R, T] the generating policy's log-probabilities (steps_per_generation > 1)
    sampler_logps: torch.Tensor | None = None  # [R, T] the sampler's (vLLM's) own, for importance sampling

    def to_bytes(self) -> bytes:
        buffer = io.BytesIO()
        torch.save(self.__dict__, buffer)
        return buffer.getvalue()

    @classmethod
    def from_bytes(cls, blob: bytes) -> Round:
        return cls(**torch.load(io.BytesIO(blob), weights_only=True))


@dataclass
class CompletionBatch:
    """A micro-batch of this rank's completions to train on."""

    prompt_ids: list[list[int]]
    completion_ids: torch.Tensor
    mask: torch.Tensor
    advantages: torch.Tensor
    old_logps: torch.Tensor | None
    sampler_logps: torch.Tensor | None = None


@dataclass
class StepSlice:
    """The global step's facts every rank knows from the round: what the loss is normalised by and the metrics
    of its completions (no collective)."""

    completions: int  # the global step's completions
    tokens: int  # their completion tokens
    tokens_norm: float  # dapo's normaliser: the round's completion tokens per step (TRL's num_items_in_batch / K)
    metrics: dict[str, float]


def completion_metrics(rewards: torch.Tensor, per_function: torch.Tensor, names: list[str],
                       completion_ids: torch.Tensor, mask: torch.Tensor, *, num_generations: int, scale_rewards: str,
                       end_ids: frozenset[int]) -> dict[str, float]:
    """TRL 1.16's names and definitions (GRPOTrainer._generate_and_score_completions) over a step's completions:
    reward (mean) and reward_std (the batch's std, Bessel-corrected: TRL's nanstd), each function's
    rewards/<name>/mean and /std (over the completions it scored: NaN where it said None), frac_reward_zero_std
    (the share of completions whose advantage's std is 0: their group's, or the batch's with scale_rewards batch),
    completions/mean_length, min_length, max_length and clipped_ratio (the share whose last token is no end token:
    cut at max_new_tokens)."""
    lengths = mask.sum(dim=1)
    if scale_rewards == "batch":
        stds = nanstd(rewards).reshape(1)
    else:
        stds = torch.stack([nanstd(group) for group in rewards.view(-1, num_generations)])
    last = completion_ids.gather(1, (lengths - 1).clamp(min=0).unsqueeze(1)).squeeze(1)
    ended = torch.tensor([int(t) in end_ids for t in last], dtype=torch.bool) | (lengths == 0)
    out = {"reward": float(rewards.nanmean()), "reward_std": float(nanstd(rewards)),
           "frac_reward_zero_std": float(torch.isclose(stds, torch.zeros_like(stds)).float().mean()),
           "completions/mean_length": float(lengths.float().mean()), "completions/min_length": float(lengths.min()),
           "completions/max_length": float(lengths.max()), "completions/clipped_ratio": float((~ended).float().mean())}
    for name, values in zip(names, per_function):
        out[f"rewards/{name}/mean"] = float(values.nanmean())
        out[f"rewards/{name}/std"] = float(nanstd(values))
    return out


class PromptRows:
    """The prompt table as the batch stream's table: a row per prompt, its micro-batch the row indices."""

    def __init__(self, table: Any):
        self.table, self.source = table, None
        self._lengths = torch.tensor([len(ids) for ids in table.prompt_ids], dtype=torch.long)

    def __len__(self) -> int:
        return len(self.table)

    def micro_batch(self, rows: torch.Tensor) -> torch.Tensor:
        return rows

    def row_tokens(self) -> torch.Tensor:
        return self._lengths

    def row_lengths(self) -> torch.Tensor:
        return self._lengths


Generate = Callable[[list[list[int]], torch.Generator], Any]  # prompt ids -> Completions (generate.py)
Score = Callable[[list[int], torch.Tensor, torch.Tensor], Any]  # rows, completion ids, mask -> Scores (rewards.py)
OldLogps = Callable[[list[list[int]], torch.Tensor, torch.Tensor], torch.Tensor]  # the generating policy's logps
Advantages = Callable[[torch.Tensor], torch.Tensor]  # the round's rewards -> advantages (losses.py)


class GrpoRounds:
    """The loop's data stream for GRPO: ``next_step()`` gives this rank's micro-batches of scored completions,
    generating a round first where the last one is used up; its state (the prompt cursor and the round not yet
    trained on) is saved with every checkpoint."""

    def __init__(self, table: Any, *, seed: int, shuffle: bool, num_generations: int, steps_per_generation: int,
                 per_rank: int, micro_batch_size: int, rank: int, world_size: int, device: torch.device,
                 generate: Generate, score: Score, advantages: Advantages, old_logps: OldLogps | None,
                 control: dist.ProcessGroup | None, step_of: Callable[[], int],
                 before_round: Callable[[int], None] | None = None,
                 after_round: Callable[[], None] | None = None, end_ids: frozenset[int] = frozenset(),
                 scale_rewards: str = "group"):
        self.table, self.seed, self.rank, self.world = table, seed, rank, world_size
        self.num_generations, self.steps_per_generation = num_generations, steps_per_generation
        self.per_rank, self.micro_batch_size, self.device = per_rank, micro_batch_size, device
        self._generate, self._score, self._advantages, self._old_logps = generate, score, advantages, old_logps
        self._control, self._step_of, self._before_round = control, step_of, before_round
        self._after_round = after_round  # a colocated vLLM engine sleeps while the ranks train
        # For the logged metrics only: where a completion ends (EOS ids and the pad id), which std scales it.
        self.end_ids, self.scale_rewards = end_ids, scale_rewards
        self.prompts = BatchStream(PromptRows(table), seed=seed, shuffle=shuffle,
                                   micro_batch_size=per_rank // num_generations, grad_accum_steps=1, dp_rank=rank,
                                   dp_world=world_size, packing="none")
        self.round: Round | None = None
        self.trained = 0  # steps of the round trained already
        self.last: StepSlice | None = None
        # Seconds of generating (with the gathers and the old policy's pass) and of scoring since the last logged step
        self._timings = {"generation_s": 0.0, "scoring_s": 0.0}

    # ------------------------------------------------------------------ the loop's side

    def next_step(self) -> StepBatch:
        if self.round is None or self.trained >= self.steps_per_generation:
            self._new_round()
        k, self.trained = self.trained, self.trained + 1
        block = self.per_rank * self.world
        mine = slice(k * block + self.rank * self.per_rank, k * block + (self.rank + 1) * self.per_rank)
        r = self.round
        step_mask = r.mask[k * block:(k + 1) * block]
        self.last = StepSlice(completions=block, tokens=int(step_mask.sum()),
                              tokens_norm=float(r.mask.sum()) / self.steps_per_generation,
                              metrics=self._metrics(slice(k * block, (k + 1) * block)))
        batches = []
        for at in range(mine.start, mine.stop, self.micro_batch_size):
            rows = slice(at, min(at + self.micro_batch_size, mine.stop))
            batches.append(CompletionBatch(
                prompt_ids=[self.table.prompt_ids[i] for i in r.rows[rows].tolist()],
                completion_ids=r.completion_ids[rows], mask=r.mask[rows], advantages=r.advantages[rows],
                old_logps=None if r.old_logps is None else r.old_logps[rows],
                sampler_logps=None if r.sampler_logps is None else r.sampler_logps[rows]))
        return StepBatch(batches, self.last.tokens, self.last.tokens)

    def _new_round(self) -> None:
        started = time.monotonic()
        heartbeat.enter(heartbeat.GENERATION)
        start_step = self._step_of()
        if self._before_round is not None:  # a generation server loads the policy of this step first
            self._before_round(start_step)
            self._timings["weight_sync_s"] = self._timings.get("weight_sync_s", 0.0) + time.monotonic() - started
        generator = torch.Generator(device=self.device).manual_seed(derived_seed(self.seed, start_step, self.rank))
        rows = torch.cat([self.prompts.next_step().micro_batches[0] for _ in range(self.steps_per_generation)])
        rows = rows.repeat_interleave(self.num_generations)  # a prompt's group: consecutive rows
        ids, masks, sampled = [], [], []
        for at in range(0, len(rows), self.per_rank):  # one step's share per call: bounded memory, equal on ranks
            part = rows[at:at + self.per_rank].tolist()
            out = self._generate([self.table.prompt_ids[i] for i in part], generator)
            ids.append(out.completion_ids.cpu())
            masks.append(out.mask.cpu())
            sampled.append(getattr(out, "logps", None))  # the sampler's log-probabilities, where it gives them
        completion_ids, mask = torch.cat(ids), torch.cat(masks)
        if self._after_round is not None:
            self._after_round()
        scored = time.monotonic()
        scores = self._score(rows.tolist(), completion_ids, mask)
        scoring = time.monotonic() - scored
        mine = {"rows": rows, "completion_ids": completion_ids, "mask": mask, "rewards": scores.total.float(),
                "per_function": torch.stack([v.float() for v in scores.per_function.values()])}
        if all(x is not None for x in sampled):
            mine["sampler_logps"] = torch.cat([x.float().cpu() for x in sampled])
        glob = self._gather(mine)
        advantages = self._advantages(glob["rewards"])
        old = None
        if self._old_logps is not None:  # later steps of the round clip against the policy that generated
            mine_old = self._old_logps([self.table.prompt_ids[i] for i in rows.tolist()], completion_ids, mask)
            old = self._gather({"old": mine_old.float().cpu()})["old"]
        self.round = Round(start_step, glob["rows"], glob["completion_ids"], glob["mask"], glob["rewards"],
                           glob["per_function"], advantages, old, glob.get("sampler_logps"))
        self.function_names = list(scores.per_function)
        self.trained = 0
        self._timings["scoring_s"] += scoring
        self._timings["generation_s"] += time.monotonic() - started - scoring
        heartbeat.enter(heartbeat.STEP)

    def _gather(self, mine: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Every rank's tensors in the round's global order (step, rank, row): one object all-gather on the host
        group. ``per_function`` is [F, rows]: joined along its rows."""
        parts: list[Any] = [None] * self.world
        if self.world > 1:
            dist.all_gather_object(parts, mine, group=self._control)
        else:
            parts = [mine]
        out = {}
        for key in mine:
            axis = 1 if key == "per_function" else 0
            steps = [p[key].chunk(self.steps_per_generation, dim=axis) for p in parts]  # [rank][k]
            out[key] = torch.cat([steps[r][k] for k in range(self.steps_per_generation) for r in range(self.world)],
                                 dim=axis)
        return out

    def _metrics(self, block: slice) -> dict[str, float]:
        r = self.round
        out = completion_metrics(r.rewards[block], r.per_function[:, block], self.function_names,
                                 r.completion_ids[block], r.mask[block], num_generations=self.num_generations,
                                 scale_rewards=self.scale_rewards, end_ids=self.end_ids)
        return {**out, "completions_distinct": self._distinct(block)}

    def _distinct(self, block: slice) -> float:
        """The share of distinct completions in a group, over the step's groups (1: no two alike; a sampler whose
        seeds collapse a group gives 1/num_generations)."""
        ids = self.round.completion_ids[block].masked_fill(~self.round.mask[block].bool(), -1)
        groups = ids.view(-1, self.num_generations, ids.shape[-1])
        return float(sum(len({tuple(row.tolist()) for row in g}) for g in groups)) / ids.shape[0]

    def take_timings(self) -> dict[str, float]:
        """Seconds spent generating and scoring since the last call (a logged step's metrics read them)."""
        taken, self._timings = self._timings, {"generation_s": 0.0, "scoring_s": 0.0}
        return {k: round(v, 4) for k, v in taken.items()}

    # ------------------------------------------------------------------ checkpoint

    ADDED = ()

    def state_dict(self) -> dict[str, Any]:
        return {"prompts": self.prompts.state_dict(), "trained": self.trained,
                "round": self.round.to_bytes() if self.round is not None else b"",
                "functions": list(getattr(self, "function_names", []))}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.prompts.load_state_dict(state["prompts"])
        self.trained = int(state["trained"])
        self.round = Round.from_bytes(state["round"]) if state["round"] else None
        self.function_names = list(state["functions"])
