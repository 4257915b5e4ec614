"""Crash consistency: ranks SIGKILLed at chosen and at random points of a checkpoint save always resume from the
newest committed step, with exactly the state that was saved (bench/crash_consistency.py runs 50 trials)."""

from __future__ import annotations

import os
import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from crash_consistency import Plan, run_trial

pytestmark = pytest.mark.distributed

# One draw per test run: xdist's workers each import this module and must collect the same tests, so under xdist
# the draw comes from the run's id, which every worker shares.
_RUN = os.environ.get("PYTEST_XDIST_TESTRUNUID")
SEED = int(os.environ.get("FSDPJOB_CRASH_SEED") or (int(_RUN[:7], 16) if _RUN else random.randrange(1 << 30)))
# Every mode once (hook pause / timer, one rank / all, sync / async), then two random draws.
PLANS = [
    Plan(seed=1, mode="pause", victims="one", rank=0, step=3, delay_s=0.2, async_save=False),
    Plan(seed=2, mode="pause", victims="one", rank=1, step=4, delay_s=0.1, async_save=True),
    Plan(seed=3, mode="pause", victims="all", rank=0, step=2, delay_s=0.0, async_save=False),
    Plan(seed=4, mode="timer", victims="one", rank=1, step=3, delay_s=0.05, async_save=False),
    Plan(seed=5, mode="timer", victims="all", rank=0, step=4, delay_s=0.15, async_save=True),
    Plan.draw(SEED, 6),
    Plan.draw(SEED + 1, 6),
]


@pytest.mark.parametrize("plan", PLANS, ids=lambda p: f"{p.mode}-{p.victims}-r{p.rank}-s{p.step}-{p.seed}")
def test_killed_save_resumes_newest_committed_step_exactly(plan: Plan, tmp_path: Path) -> None:
    out = run_trial(plan, tmp_path, steps=6)
    print(f"FSDPJOB_CRASH_SEED={SEED}: {plan} -> committed {out.committed}, partial {out.partial_left}, "
          f"acked {out.acked}, resumed {out.resumed}")  # fmt: skip
    assert out.problems == [], f"{out.problems} (FSDPJOB_CRASH_SEED={SEED})"
    assert out.resumed is not None and out.resumed == max(out.committed) >= out.acked >= plan.step - 2
    if plan.mode == "pause":  # the hook held a rank after its shard: that step never committed
        assert out.resumed < plan.step and out.partial_left == [plan.step]
