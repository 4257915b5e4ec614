"""One optimizer step of a preference method over this rank's micro-batches of pairs (or kto's answers).

The loss is the mean over the global batch's examples (pairs; kto's answers): each micro-batch's summed losses
are divided by the global batch's example count and scaled by the world size (FSDP averages gradients over
ranks), as jobs/step.py does with target tokens for SFT. The metrics are sums (and the counts they are divided
by, the objective says which: objective.Ratio), all-reduced with the loss in one collective when a log step reads
them (every rank reads at the same steps).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist

from ..step import StepValues
from .batches import policy_logps
from .objective import Objective, Ratio

# (model, micro-batch, device) -> per row of batches.answer_rows: the value the objective reads (the answer's summed
# log-probability; a reward model's score) and the answer's token count.
Forward = Callable[[torch.nn.Module, object, torch.device], tuple[torch.Tensor, torch.Tensor]]


class PairStepValues(StepValues):
    """A preference step's mean loss, gradient norm and metrics, read lazily (one all-reduce)."""

    def __init__(self, sums: torch.Tensor, pairs: int, tokens: int, grad_norm: torch.Tensor, processed: int,
                 metrics: tuple[Ratio, ...] = ()):
        super().__init__(sums[0], tokens, grad_norm, processed)
        self._sums, self._pairs, self._ratios = sums, pairs, metrics
        self._metrics: dict[str, float] | None = None

    def _values(self) -> tuple[float, float]:
        if self._read is None:
            dist.all_reduce(self._sums)
            self._metrics = ratios(self._sums, self._pairs, self._ratios)
            self._read = (float(self._sums[0]) / max(self._pairs, 1), self._norm())
        return self._read

    def extra(self) -> dict[str, float]:
        self._values()
        return dict(self._metrics or {})


def ratios(sums: torch.Tensor, examples: int, metrics: tuple[Ratio, ...]) -> dict[str, float]:
    """The logged metrics from a step's (or an evaluation's) reduced sums: [loss, objective sums...]; a metric
    over a count that is 0 here is left out (TRL logs it only then)."""
    values = sums[1:].tolist()
    return {r.name: values[r.numerator] / (max(examples, 1) if r.denominator is None else values[r.denominator])
            for r in metrics if r.denominator is None or values[r.denominator] > 0}


# A micro-batch's reference log-probabilities [B, 2] (cached: looked up by its rows; live: a forward).
ReferenceOf = Callable[[object], torch.Tensor | None]


def rank_mean(value: torch.Tensor) -> torch.Tensor:
    """``value``'s mean over every rank (one all-reduce on the default group; kto's KL estimate per micro-batch,
    as TRL's gather_for_metrics(kl).mean())."""
    total = value.clone()
    dist.all_reduce(total)
    return total / dist.get_world_size()


def preference_step(model, optimizer, micro_batches, device: torch.device, *, objective: Objective,
                    reference_of: ReferenceOf, pairs: int, tokens: int, max_grad_norm: float,
                    processed: int = 0, forward: Forward = policy_logps) -> PairStepValues:
    scale = dist.get_world_size() / max(float(pairs), 1.0)
    sums = torch.zeros(1 + objective.sums, dtype=torch.float32, device=device)
    for batch in micro_batches:
        reference = reference_of(batch)
        logps, counts = forward(model, batch, device)
        out = objective(logps, counts, reference, batch)
        (out.losses.sum() * scale).backward()
        sums += torch.cat([out.losses.detach().sum().float().reshape(1), out.metric_sums.to(device)])
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm if max_grad_norm > 0 else math.inf)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return PairStepValues(sums, pairs, tokens, norm, processed, objective.metrics)
