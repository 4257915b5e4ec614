"""One GRPO optimizer step over this rank's micro-batches of scored completions (rounds.py).

Each micro-batch's loss is its share of TRL's loss over the global step (losses.py normalises by the global step's
completions or tokens, which every rank knows from the round), scaled by the world size because FSDP averages the
gradients over ranks, as jobs/step.py does for SFT. The KL and clip metrics are sums and counts, all-reduced with
the loss in one collective when a log step reads them; the rewards' metrics are known on every rank already.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist

from ..step import StepValues
from .losses import TokenTerms, loss_terms, metric_means, metric_sums, reduce
from .rounds import CompletionBatch, StepSlice

# (micro-batch) -> the reference's per-token log-probabilities [rows, T], or None without a reference (beta 0)
ReferenceOf = Callable[[CompletionBatch], torch.Tensor | None]
# (model, prompt ids, completion ids, mask) -> per-token log-probabilities and entropies [rows, T] each
# (generate.completion_logps with entropy=True)
Logps = Callable[[torch.nn.Module, list[list[int]], torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


class GrpoStepValues(StepValues):
    """A GRPO step's loss, gradient norm and metrics (TRL's names), read lazily (one all-reduce of [loss, the
    metric sums])."""

    def __init__(self, sums: torch.Tensor, step: StepSlice, grad_norm: torch.Tensor, *, beta: float,
                 timings: Callable[[], dict[str, float]], sampler: torch.Tensor | None = None):
        super().__init__(sums[0], step.tokens, grad_norm, step.tokens)
        self._sums, self._step, self._beta, self._timings = sums, step, beta, timings
        self._sampler = sampler  # [KL sum, tokens, max ratio] against the sampler's log-probabilities (vLLM)
        self._metrics: dict[str, float] | None = None

    def _values(self) -> tuple[float, float]:
        if self._read is None:
            dist.all_reduce(self._sums)
            means = metric_means(self._sums[1:], beta=self._beta)
            means["clip_ratio"] = means["clip_ratio/region_mean"]  # the (and older TRL's) name
            self._metrics = {**self._step.metrics, **means, **self._mismatch()}
            # The sum of every micro-batch's share is the step's loss already (losses.reduce normalises).
            self._read = (float(self._sums[0]), self._norm())
        return self._read

    def _mismatch(self) -> dict[str, float]:
        """The sampler against the trainer over the step's tokens: sampler_kl (KL(sampler || trainer), k3 on the
        sampled tokens) and sampler_ratio_max (the largest pi_trainer / pi_sampler, before truncation)."""
        if self._sampler is None:
            return {}
        sums, top = self._sampler[:2].clone(), self._sampler[2:].clone()
        dist.all_reduce(sums)
        dist.all_reduce(top, op=dist.ReduceOp.MAX)
        return {"sampler_kl": float(sums[0]) / max(float(sums[1]), 1.0), "sampler_ratio_max": float(top[0])}

    def extra(self) -> dict[str, float]:
        """The logged metrics (only log steps read them: a save's read of the loss leaves the timings alone)."""
        self._values()
        if "generation_s" not in self._metrics:
            # Seconds of generating and of scoring since the last logged step (goodput's split of productive time).
            self._metrics.update(self._timings())
        return dict(self._metrics)


def grpo_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, micro_batches: list[CompletionBatch],
              step: StepSlice, *, logps_of: Logps, reference_of: ReferenceOf, options, max_grad_norm: float,
              timings: Callable[[], dict[str, float]]) -> GrpoStepValues:
    world = dist.get_world_size()
    sums = sampler = None
    for batch in micro_batches:
        reference = reference_of(batch)
        logps, entropy = logps_of(model, batch.prompt_ids, batch.completion_ids, batch.mask)
        device = logps.device
        mask = batch.mask.to(device)
        terms = loss_terms(logps, None if batch.old_logps is None else batch.old_logps.to(device),
                           None if reference is None else reference.to(device), batch.advantages.to(device),
                           epsilon=options.epsilon, epsilon_high=options.epsilon_high, beta=options.beta)
        if batch.sampler_logps is not None:
            terms, part = importance_sampling(terms, logps, batch, mask, options.tis_cap)
            sampler = part if sampler is None else torch.cat([sampler[:2] + part[:2], sampler[2:].max(part[2:])])
        share = reduce(terms.per_token, mask, options.loss_type, completions_global=step.completions,
                       tokens_global=step.tokens_norm, max_new_tokens=options.max_new_tokens)
        (share * world).backward()  # FSDP averages the gradients over the ranks
        part = torch.cat([share.detach().float().reshape(1), metric_sums(terms, mask, entropy)])
        sums = part if sums is None else sums + part
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm if max_grad_norm > 0 else math.inf)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return GrpoStepValues(sums, step, norm, beta=options.beta, timings=timings, sampler=sampler)


def importance_sampling(terms: TokenTerms, logps: torch.Tensor, batch: CompletionBatch, mask: torch.Tensor,
                        cap: float | None) -> tuple[TokenTerms, torch.Tensor]:
    """Truncated importance sampling against the sampler (TRL's vllm_importance_sampling_correction, token level):
    each token's loss times min(pi_old / pi_sampler, cap), pi_old the generating policy as the trainer computes it
    (the round's old log-probabilities, or this pass's own detached when the round trains one step); ``cap`` None:
    the loss unchanged. Also [KL sum, tokens, max ratio] over the micro-batch's tokens for the logged mismatch."""
    trainer = (logps.detach() if batch.old_logps is None else batch.old_logps.to(logps.device)).float()
    log_ratio = trainer - batch.sampler_logps.to(logps.device).float()
    ratio = torch.exp(log_ratio)
    m = mask.to(torch.float32)
    kl = ((ratio - 1 - log_ratio) * m).sum()
    top = torch.where(mask.bool(), ratio, torch.zeros_like(ratio)).max()
    if cap is not None:
        terms = terms._replace(per_token=terms.per_token * ratio.clamp(max=cap))
    return terms, torch.stack([kl, m.sum(), top]).detach()
