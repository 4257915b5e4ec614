"""One optimizer step (forward and backward over this rank's micro-batches, clip, AdamW) and its values.

Nothing here makes the host wait for the device: the global token count travels with the loop's stop/save
flags in one host collective per step (StepAgreement) that overlaps the first forward, and the loss and
gradient norm stay where they were computed until a log or save step reads them (StepValues), which every
rank does at the same steps.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .data import count_tokens


# torch 2.13 renamed all_gather_into_tensor (deprecated there, with a warning per call site); older torch has
# only the old name.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class StepAgreement:
    """The step's one host collective: the global count of real target tokens (summed over ranks: the loss's
    denominator) and the loop's stop/save flags (the largest value over ranks).

    One all-gather of a few int64 per rank over the control group (jobs/dist.py), started before the forward
    and waited for only where a value is first read: the tokens before the first backward, the flags after
    the step. Host tensors over gloo, so agreeing never waits for the device, and the first micro-batch's
    forward runs while the values travel. Every rank starts one per step, in the same order.
    """

    def __init__(self, local_tokens: int, flags: Sequence[int], control: dist.ProcessGroup | None):
        self._send = torch.tensor([local_tokens, *flags], dtype=torch.int64)
        self._recv = torch.empty(dist.get_world_size(control) * len(self._send), dtype=torch.int64)
        self._work = _all_gather_single(self._recv, self._send, group=control, async_op=True)
        self._columns: list[tuple[int, ...]] | None = None

    def _read(self) -> list[tuple[int, ...]]:
        """The gathered values, one tuple per field (the ranks' values), read into Python once."""
        if self._columns is None:
            self._work.wait()
            width = len(self._send)
            values = self._recv.tolist()  # rank after rank; plain ints from here: no tensor op per read
            self._columns = [tuple(values[i::width]) for i in range(width)]
        return self._columns

    @property
    def tokens(self) -> int:
        """Real target tokens of the global batch."""
        return sum(self._read()[0])

    @property
    def flags(self) -> tuple[int, ...]:
        """Each flag's largest value over the ranks."""
        return tuple(max(column) for column in self._read()[1:])


def local_tokens(micro_batches) -> int:
    """Real target tokens of this rank's micro-batches, counted on the host (labels are still CPU tensors)."""
    return sum(count_tokens(mb.labels) for mb in micro_batches)


class StepValues:
    """A trained step's loss and gradient norm, read lazily: the first read costs one all-reduce of the loss
    (and a host sync on GPUs), so every rank must read at the same steps; later reads are free."""

    def __init__(self, loss_sum: torch.Tensor, tokens: int, grad_norm: torch.Tensor):
        self.tokens = tokens  # real target tokens of the global batch
        self._loss_sum, self._grad_norm = loss_sum, grad_norm
        self._read: tuple[float, float] | None = None

    def _values(self) -> tuple[float, float]:
        if self._read is None:
            dist.all_reduce(self._loss_sum)
            norm = self._grad_norm  # a DTensor from sharded gradients: its full value is one more collective
            norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
            self._read = (self._loss_sum.item() / max(float(self.tokens), 1.0), float(norm))
        return self._read

    @property
    def loss(self) -> float:
        """Mean loss over the global batch's real target tokens."""
        return self._values()[0]

    @property
    def grad_norm(self) -> float:
        """Total gradient norm before clipping."""
        return self._values()[1]


def train_step(model, optimizer, micro_batches, device: torch.device, *, max_grad_norm: float,
               control: dist.ProcessGroup | None, agreed: StepAgreement | None = None,
               defer_grad_sync: bool = False) -> StepValues:
    """One optimizer step over this rank's micro-batches.

    The loss is the mean over real (unmasked) target tokens of the whole global batch, across
    micro-batches and ranks: each micro-batch's summed token loss is divided by the global token count.
    FSDP averages gradients over ranks, so the local loss is scaled by the world size to undo that mean.
    With ``defer_grad_sync`` (the planner decided the unsharded fp32 gradients fit), the micro-batches
    before the last accumulate locally and only the last one reduce-scatters. ``agreed`` is the step's
    StepAgreement when the loop started one (with its flags); without it the step starts its own.
    """
    world = dist.get_world_size()
    agreed = agreed or StepAgreement(local_tokens(micro_batches), (), control)
    scale = None  # known once the token count has arrived: read at the first backward, after a forward
    loss_sum = torch.zeros((), dtype=torch.float32, device=device)
    last = len(micro_batches) - 1
    for i, mb in enumerate(micro_batches):
        if defer_grad_sync and last:
            model.set_requires_gradient_sync(i == last)
        input_ids, labels = mb.input_ids.to(device), mb.labels.to(device)
        logits = model(input_ids=input_ids, use_cache=False).logits
        # Shift the labels, not the logits: slicing the (batch, seq, vocab) logits would copy them.
        targets = F.pad(labels[:, 1:], (0, 1), value=-100)
        token_loss = F.cross_entropy(
            logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1), ignore_index=-100, reduction="sum"
        )
        if scale is None:
            scale = world / max(float(agreed.tokens), 1.0)
        (token_loss * scale).backward()
        loss_sum += token_loss.detach()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm if max_grad_norm > 0 else math.inf)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return StepValues(loss_sum, agreed.tokens, norm)


def eval_loss(model, micro_batches, device: torch.device) -> tuple[float, int]:
    """Mean loss over the real target tokens of every rank's evaluation micro-batches, and their count.

    The same reduction as train_step's loss (summed token losses over the global token count), with the
    model in eval mode and no autograd; the model is put back in train mode. Collective: every rank calls it
    with the same number of micro-batches (jobs/data.py eval_batches).
    """
    model.eval()
    totals = torch.zeros(2, dtype=torch.float64, device=device)  # [summed token loss, target tokens]
    try:
        with torch.no_grad():
            for mb in micro_batches:
                input_ids, labels = mb.input_ids.to(device), mb.labels.to(device)
                logits = model(input_ids=input_ids, use_cache=False).logits
                targets = F.pad(labels[:, 1:], (0, 1), value=-100)
                token_loss = F.cross_entropy(
                    logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1), ignore_index=-100,
                    reduction="sum",
                )
                totals[0] += token_loss.double()
                totals[1] += count_tokens(mb.labels)
    finally:
        model.train()
    dist.all_reduce(totals)
    loss_sum, tokens = totals.tolist()
    return loss_sum / max(tokens, 1.0), int(tokens)
