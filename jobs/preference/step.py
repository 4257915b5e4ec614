"""One optimizer step of a preference method over this rank's micro-batches of pairs.

The loss is the mean over the global batch's pairs: each micro-batch's summed pair losses are divided by the
global batch's pair count and scaled by the world size (FSDP averages gradients over ranks), as jobs/step.py
does with target tokens for SFT. The metrics are sums over the pairs, all-reduced with the loss in one
collective when a log step reads them (every rank reads at the same steps).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist

from ..step import StepValues
from .batches import answer_rows, concatenated_logps
from .objective import PAIR_METRICS, Objective


class PairStepValues(StepValues):
    """A preference step's mean pair loss, gradient norm and metrics, read lazily (one all-reduce)."""

    def __init__(self, sums: torch.Tensor, pairs: int, tokens: int, grad_norm: torch.Tensor, processed: int):
        super().__init__(sums[0], tokens, grad_norm, processed)
        self._sums, self._pairs = sums, pairs
        self._metrics: dict[str, float] | None = None

    def _values(self) -> tuple[float, float]:
        if self._read is None:
            dist.all_reduce(self._sums)
            norm = self._grad_norm
            norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
            totals = (self._sums / max(self._pairs, 1)).tolist()
            self._metrics = dict(zip(PAIR_METRICS, totals[1:]))
            self._read = (totals[0], float(norm))
        return self._read

    def extra(self) -> dict[str, float]:
        self._values()
        return dict(self._metrics or {})


# A micro-batch's reference log-probabilities [B, 2] (cached: looked up by its rows; live: a forward).
ReferenceOf = Callable[[object], torch.Tensor | None]


def preference_step(model, optimizer, micro_batches, device: torch.device, *, objective: Objective,
                    reference_of: ReferenceOf, pairs: int, tokens: int, max_grad_norm: float,
                    processed: int = 0) -> PairStepValues:
    scale = dist.get_world_size() / max(float(pairs), 1.0)
    sums = torch.zeros(1 + len(PAIR_METRICS), dtype=torch.float32, device=device)
    for batch in micro_batches:
        reference = reference_of(batch)
        ids, labels = answer_rows(batch)
        logps, counts = concatenated_logps(model, ids, labels, device)
        out = objective(logps, counts, reference)
        (out.losses.sum() * scale).backward()
        sums += torch.cat([out.losses.detach().sum().float().reshape(1), out.metric_sums.to(device)])
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm if max_grad_norm > 0 else math.inf)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return PairStepValues(sums, pairs, tokens, norm, processed)
