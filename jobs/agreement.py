"""The ranks' agreement on the loop's stop/save flags: an all-gather that travels while a step trains.

Every rank holds the same flags after the step that carried an agreement, so every rank saves and stops at
the same step. Which steps carry one is the same on every rank too: each agreement also carries rank 0's
choice of how many steps to wait for the next (orchestrator/core/stopping.py: about half a second of
steps, every step when a step is longer), and every rank takes rank 0's. Host tensors over the control
group (gloo), so agreeing never waits for the device.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist

from fsdpjob.orchestrator.core.stopping import steps_between

# torch 2.13 renamed all_gather_into_tensor (deprecated there, with a warning per call site); older torch has
# only the old name.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class FlagAgreement:
    """``begin(step, flags)`` before a step trains and ``end(step)`` after it, on every rank at every step.

    ``flags`` are non-negative ints; ``end`` returns each one's largest value over the ranks for a step that
    carried an agreement, and zeros for the others. ``always_at`` are steps that carry one whatever the
    interval (the stop-at-step test hook: every rank knows it, so the stop lands on that exact step).
    """

    def __init__(self, width: int, control: dist.ProcessGroup | None, *, always_at: Iterable[int] = ()):
        self._width, self._control = width, control
        self._world, self._is_main = dist.get_world_size(control), dist.get_rank() == 0
        self._always_at = frozenset(always_at)
        self._next: int | None = None  # the next step to carry one; None: the first step begun
        self._pending: tuple[int, dist.Work, torch.Tensor] | None = None
        self._mark: tuple[int, float] | None = None  # rank 0: (step, time) at the last agreement it began

    def carries(self, step: int) -> bool:
        return self._next is None or step >= self._next or step in self._always_at

    def begin(self, step: int, flags: Sequence[int]) -> None:
        if not self.carries(step):
            return
        send = torch.tensor([*flags, self._proposal(step)], dtype=torch.int64)
        recv = torch.empty(self._world * len(send), dtype=torch.int64)
        self._pending = (step, _all_gather_single(recv, send, group=self._control, async_op=True), recv)

    def end(self, step: int) -> tuple[int, ...]:
        if self._pending is None or self._pending[0] != step:
            return (0,) * self._width
        _, work, recv = self._pending
        self._pending = None
        work.wait()
        values = recv.tolist()  # rank after rank: flags..., proposal
        per_rank = self._width + 1
        self._next = step + values[self._width]  # rank 0's proposal, the same on every rank
        return tuple(max(values[i::per_rank]) for i in range(self._width))

    def _proposal(self, step: int) -> int:
        """Rank 0's steps to the next agreement, from its mean step time since the last one (others send 0)."""
        if not self._is_main:
            return 0
        now, mark = time.perf_counter(), self._mark
        self._mark = (step, now)
        if mark is None or step <= mark[0]:
            return 1  # nothing measured yet: agree again at the next step
        return steps_between((now - mark[1]) / (step - mark[0]))
