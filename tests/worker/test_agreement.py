"""The ranks' stop/save flag agreement (jobs/agreement.py) on real gloo ranks, and its interval rule."""

from __future__ import annotations

import math
import time

import pytest
from distributed import run_ranks

from fsdpjob.orchestrator.core.stopping import AGREE_EVERY_S, MAX_STEPS_BETWEEN, steps_between, stop_wait_s

STEP_S = 0.05  # a step's time in the test: ten steps per agreement
SIGNAL_AT = {1: 23}  # rank -> the step before which its stop flag goes up


def agree(rank: int, world_size: int, steps: int, always_at: list[int]) -> list[tuple[int, bool, tuple[int, ...]]]:
    """Run ``steps`` steps of STEP_S; return (step, carried, flags) for every step."""
    import torch.distributed as dist

    from fsdpjob.jobs.agreement import FlagAgreement

    dist.init_process_group("gloo")
    try:
        agreement = FlagAgreement(2, None, always_at=always_at)
        seen, signum = [], 0
        for step in range(1, steps + 1):
            if step == SIGNAL_AT.get(rank):
                signum = 12
            carried = agreement.carries(step)
            agreement.begin(step, (signum, 7 if rank == 0 else 0))
            time.sleep(STEP_S)  # the step trains while the flags travel
            seen.append((step, carried, agreement.end(step)))
        return seen
    finally:
        dist.destroy_process_group()


def test_every_rank_agrees_on_the_same_steps_with_the_same_flags():
    ranks = run_ranks(agree, 2, steps=60, always_at=[47])
    assert ranks[0] == ranks[1]  # same carrying steps, same flags, on every rank
    seen = ranks[0]
    carried = [step for step, was, _ in seen if was]
    assert carried[:2] == [1, 2]  # the first steps carry one until rank 0 has timed a step
    assert 47 in carried  # the test hook's step, whatever the interval
    gaps = [b - a for a, b in zip(carried[1:], carried[2:]) if 47 not in (a, b)]
    # About AGREE_EVERY_S of STEP_S steps: 10, or fewer where steps ran slow (a loaded machine), never more.
    assert all(3 <= gap <= int(AGREE_EVERY_S / STEP_S) for gap in gaps), carried
    for step, was, flags in seen:
        if not was:
            assert flags == (0, 0)
        else:
            assert flags[1] == 7  # rank 0's value reaches every rank
            assert flags[0] == (12 if step >= SIGNAL_AT[1] else 0)  # rank 1's signal too
    # Rank 1's signal went up before step 23; the first step carrying it ends within one interval.
    first = next(step for step, _, flags in seen if flags[0])
    assert SIGNAL_AT[1] <= first < SIGNAL_AT[1] + int(AGREE_EVERY_S / STEP_S)


@pytest.mark.parametrize("step_s, k", [(None, 1), (0.0, 1), (math.inf, 1), (2.0, 1), (0.5, 1), (0.3, 1),
                                       (0.24, 2), (0.05, 10), (0.041, 12), (1e-5, MAX_STEPS_BETWEEN)])
def test_steps_between_agreements_cover_about_half_a_second(step_s, k):
    assert steps_between(step_s) == k


@pytest.mark.parametrize("step_s", [0.001, 0.04, 0.24, 0.26, 1.0, 9.0])
def test_the_stop_wait_bound_covers_the_interval_and_the_carrying_step(step_s):
    # A signal just after an agreement started waits for the steps to the next one, then the step carrying it.
    worst = (steps_between(step_s) + 1) * step_s
    assert worst <= stop_wait_s(step_s) <= worst + AGREE_EVERY_S + step_s
