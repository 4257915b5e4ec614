"""One optimizer step (forward and backward over this rank's micro-batches, clip, AdamW) and its values.

Nothing here makes the host wait for the device or for the other ranks beyond FSDP's own collectives and the
gradient clip's norm. On CUDA a micro-batch goes to the device from pinned host memory with non_blocking copies
(to_device), and the next one's copy is queued before the current one's forward, so the host never waits for
the stream to drain before it issues the next kernels. The loss's denominator (the global batch's target tokens) comes
with the step's data,
counted by every rank from the whole table it holds (jobs/data/stream.py BatchStream), and the loss and gradient
norm stay where they were computed until a log or save step reads them (StepValues), which every rank does
at the same steps. ``EvalSchedule`` is every method's evaluation schedule.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

from fsdpjob.orchestrator.core.jobspec.families import logit_transform
from fsdpjob.orchestrator.core.jobspec.methods import facts_of

from .data.packing import count_tokens
from .model.chunkedloss import CHUNK_TOKENS, chunked_loss_sum
from .model.router import aux_term, routed_values, router_tap
from .model.varlen import NAME as VARLEN_NAME
from .model.varlen import SeqLens, model_kwargs, seq_lens

# Attention implementations that take a packed micro-batch flattened, with its boundaries as kwargs.
VARLEN_IMPLEMENTATIONS = (VARLEN_NAME, "flash_attention_2")


class StepValues:
    """A trained step's loss and gradient norm, read lazily: the first read costs one all-reduce of the loss
    (and a host sync on GPUs), so every rank must read at the same steps; later reads are free."""

    def __init__(self, loss_sum: torch.Tensor, tokens: int, grad_norm: torch.Tensor, processed: int = 0):
        self.tokens = tokens  # real target tokens of the global batch
        self.processed = processed or tokens  # its non-pad positions (tokens/s, MFU); unknown: the targets
        self._loss_sum, self._grad_norm = loss_sum, grad_norm
        self._read: tuple[float, float] | None = None

    def _values(self) -> tuple[float, float]:
        if self._read is None:
            dist.all_reduce(self._loss_sum)
            self._read = (self._loss_sum.item() / max(float(self.tokens), 1.0), self._norm())
        return self._read

    def _norm(self) -> float:
        """The gradient norm's value: a DTensor from sharded gradients, whose full value is one more collective."""
        norm = self._grad_norm
        return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)

    @property
    def loss(self) -> float:
        """Mean loss over the global batch's real target tokens."""
        return self._values()[0]

    @property
    def grad_norm(self) -> float:
        """Total gradient norm before clipping."""
        return self._values()[1]

    def extra(self) -> dict[str, float]:
        """A method's own metrics (preference training's rewards and log-probabilities); none for SFT."""
        return {}


class EvalSchedule:
    """Evaluates at every ``eval_every`` steps and at the end; every method runs on all ranks. A subclass's
    ``run(step)`` evaluates, records ``last`` and returns the eval loss (jobs/sft/evaluate.py's,
    jobs/preference/evaluate.py's).

    The schedule depends on the step alone, so a resumed or resharded run evaluates at the same steps.
    """

    def __init__(self, eval_every: int):
        self.eval_every = eval_every
        self.last: tuple[int, float] | None = None  # (step, eval loss) of the latest evaluation of this start

    def run(self, step: int) -> float:
        raise NotImplementedError

    def maybe_run(self, step: int) -> None:
        if step % self.eval_every == 0:
            self.run(step)

    def run_final(self, step: int, start_step: int) -> None:
        """After the last step: evaluate unless this start trained no step or already evaluated this one."""
        if step > start_step and (self.last is None or self.last[0] != step):
            self.run(step)

    def loss_at(self, step: int) -> float | None:
        """The eval loss of ``step`` when this start evaluated it (what a checkpoint of that step records)."""
        return self.last[1] if self.last is not None and self.last[0] == step else None


def loss_chunk_tokens(method: str, loss: str, worker_facts: Mapping[str, Any], config: Mapping[str, Any]) -> int:
    """The chunk of train.loss as the SFT step runs it (0: the standard loss). auto is the planner's decision, read
    here and nowhere else: spec.json's worker_facts["loss"] (standard or chunked), standard where the plan wrote
    none, and standard for a model (``config``: its config.json) that transforms its logits after lm_head, which
    the chunks would skip (an explicit chunked is refused at submit; here too, for a spec that got past). A method
    whose loss reads the logits itself (core/jobspec/methods.py's MethodFacts.chunked_loss: all but sft) computes
    its own log-probabilities (the spec refuses chunked for it)."""
    chosen = (worker_facts.get("loss") or "standard") if loss == "auto" else loss
    if not facts_of(method).chunked_loss or chosen != "chunked":
        return 0
    if (transform := logit_transform(config)) is None:
        return CHUNK_TOKENS
    if loss == "auto":
        return 0
    raise ValueError(f"train.loss: chunked cannot train this {config.get('model_type')} model: its forward "
                     f"transforms the logits after lm_head ({transform}); set train.loss: standard or auto")


def copy_is_async(device: torch.device) -> bool:
    """Whether host-to-device copies pin the source and return at once: only to CUDA. A pageable source
    makes every copy a memcpy plus a stream synchronize (the host waits for the previous backward); CPU
    tensors are used as they are."""
    return device.type == "cuda"


class OnDevice(NamedTuple):
    """A micro-batch's tensors on the step's device."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor | None  # boundary-aware packing's per-example positions; None otherwise
    seq_lens: SeqLens | None = None  # the same boundaries for varlen attention, computed on the host


def to_device(mb, device: torch.device) -> OnDevice:
    """A micro-batch's input ids, labels and position ids on ``device``. On CUDA, pinned and copied non-blocking:
    the copy is queued on the current stream (ordered before the forward that reads it) and the pinned buffer is
    kept by the caching host allocator until the copy has run. The position ids (boundary-aware packing, the
    default) go the same way: a pageable copy of them alone would sync the host once per micro-batch. Their
    example boundaries are read here, from the host copy, once per micro-batch (varlen.seq_lens)."""
    tensors = (mb.input_ids, mb.labels, mb.position_ids)
    lens = seq_lens(mb.position_ids) if mb.position_ids is not None else None
    if not copy_is_async(device):
        return OnDevice(*(t if t is None else t.to(device) for t in tensors), lens)
    return OnDevice(*(t if t is None else t.pin_memory().to(device, non_blocking=True) for t in tensors), lens)


def _prefetched(micro_batches, device: torch.device):
    """Each micro-batch on the device, the next one's copy issued before the current one is handed out."""
    ahead = to_device(micro_batches[0], device) if micro_batches else None
    for i in range(len(micro_batches)):
        current = ahead
        ahead = to_device(micro_batches[i + 1], device) if i + 1 < len(micro_batches) else None
        yield current


def _forward_inputs(model, input_ids: torch.Tensor, position_ids: torch.Tensor | None, device: torch.device,
                   flatten: bool | None, lens: SeqLens | None) -> tuple[dict, bool]:
    """The keywords the model's forward takes for a micro-batch (forward_logits says which), and whether its rows
    went flattened into one."""
    if position_ids is None:
        return {"input_ids": input_ids}, False
    if flatten is None:
        flatten = getattr(model.config, "_attn_implementation", None) in VARLEN_IMPLEMENTATIONS
    if flatten and lens is None:
        lens = seq_lens(position_ids.cpu())  # callers without to_device's boundaries (tests, a host tensor here)
    position_ids = position_ids.to(device)
    if not flatten:
        return {"input_ids": input_ids, "position_ids": position_ids}, False
    return {"input_ids": input_ids.reshape(1, -1), "position_ids": position_ids.reshape(1, -1),
            **model_kwargs(lens, device)}, True


def forward_logits(model, input_ids: torch.Tensor, position_ids: torch.Tensor | None, device: torch.device,
                   *, flatten: bool | None = None, lens: SeqLens | None = None) -> torch.Tensor:
    """The model's logits [B, L, V] for ``input_ids`` on ``device``.

    With boundary-aware packing (``position_ids`` given, no attention mask), transformers' sdpa and eager paths
    read the example boundaries from where the positions restart and build a dense block-diagonal causal mask
    per row. The varlen paths (fsdpjob's varlen attention, flash_attention_2) take the rows as one flattened row
    (every row's first example starts at position 0, so rows stay apart) with the boundaries computed once on the
    host (``lens``; from ``position_ids`` if not given), and the logits come back in rows; ``flatten``
    overrides that choice (tests).
    """
    inputs, flattened = _forward_inputs(model, input_ids, position_ids, device, flatten, lens)
    logits = model(**inputs, use_cache=False).logits
    return logits.view(*input_ids.shape, logits.size(-1)) if flattened else logits


def token_loss_sum(model, input_ids: torch.Tensor, labels: torch.Tensor, position_ids: torch.Tensor | None,
                   device: torch.device, *, lens: SeqLens | None = None, chunk_tokens: int = 0,
                   flatten: bool | None = None) -> torch.Tensor:
    """The micro-batch's summed token cross-entropy in fp32 (labels -100: not counted). ``chunk_tokens`` 0: over
    the whole micro-batch's logits (train.loss standard); otherwise in chunks of that many tokens, never holding
    more than one chunk's logits (standard's loss within fp32 summation order; jobs/model/chunkedloss.py)."""
    # Shift the labels, not the logits: slicing the (batch, seq, vocab) logits would copy them.
    targets = F.pad(labels[:, 1:], (0, 1), value=-100)
    if chunk_tokens:
        inputs, _ = _forward_inputs(model, input_ids, position_ids, device, flatten, lens)
        return chunked_loss_sum(model, targets=targets, chunk_tokens=chunk_tokens, **inputs)
    logits = forward_logits(model, input_ids, position_ids, device, lens=lens, flatten=flatten)
    return F.cross_entropy(
        logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1), ignore_index=-100, reduction="sum"
    )


def train_step(model, optimizer, micro_batches, device: torch.device, *, tokens: int, max_grad_norm: float,
               defer_grad_sync: bool = False, processed: int = 0, chunk_tokens: int = 0) -> StepValues:
    """One optimizer step over this rank's micro-batches.

    The loss is the mean over real (unmasked) target tokens of the whole global batch, across
    micro-batches and ranks: each micro-batch's summed token loss is divided by ``tokens``, the global batch's
    count (StepBatch.tokens). FSDP averages gradients over ranks, so the local loss is scaled by the world
    size to undo that mean. With ``defer_grad_sync`` (the planner decided the unsharded fp32 gradients fit),
    the micro-batches before the last accumulate locally and only the last one reduce-scatters. ``chunk_tokens``:
    the chunked loss's chunk (train.loss chunked), 0 for the standard loss (token_loss_sum).
    """
    scale = dist.get_world_size() / max(float(tokens), 1.0)
    loss_sum = torch.zeros((), dtype=torch.float32, device=device)
    last = len(micro_batches) - 1
    tap = router_tap(model)  # MoE: load-balancing loss and router metrics (jobs/model/router.py)
    for i, (input_ids, labels, position_ids, lens) in enumerate(_prefetched(micro_batches, device)):
        if defer_grad_sync and last:
            model.set_requires_gradient_sync(i == last)
        if tap is not None:
            tap.arm()
        token_loss = token_loss_sum(model, input_ids, labels, position_ids, device, lens=lens,
                                    chunk_tokens=chunk_tokens)
        (token_loss * scale + aux_term(tap, len(micro_batches))).backward()
        loss_sum += token_loss.detach()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm if max_grad_norm > 0 else math.inf)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    values = StepValues(loss_sum, tokens, norm, processed)
    return values if tap is None else routed_values(tap, values)


def eval_loss(model, micro_batches, device: torch.device, *, chunk_tokens: int = 0) -> tuple[float, int]:
    """Mean loss over the real target tokens of every rank's evaluation micro-batches, and their count.

    The same reduction as train_step's loss (summed token losses over the global token count), with the
    model in eval mode and no autograd (the chunked loss too: an evaluation's logits would otherwise be the peak
    that chunking removed from training); the model is put back in train mode. Collective: every rank calls it
    with the same number of micro-batches (jobs/data/stream.py eval_batches).
    """
    model.eval()
    totals = torch.zeros(2, dtype=torch.float64, device=device)  # [summed token loss, target tokens]
    try:
        with torch.no_grad():
            for mb in micro_batches:
                input_ids, labels, position_ids, lens = to_device(mb, device)
                token_loss = token_loss_sum(model, input_ids, labels, position_ids, device, lens=lens,
                                            chunk_tokens=chunk_tokens)
                totals[0] += token_loss.double()
                totals[1] += count_tokens(mb.labels)
    finally:
        model.train()
    dist.all_reduce(totals)
    loss_sum, tokens = totals.tolist()
    return loss_sum / max(tokens, 1.0), int(tokens)
