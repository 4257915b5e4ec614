"""The planner's per-rank peak is within 15 % of the peak RSS of real FSDP2 training steps on CPU (gloo)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from plan_accuracy import MOE, QUICK, Case, measure, predict, write_model

pytestmark = pytest.mark.distributed


CASES = [*QUICK, MOE[0]]  # and a tiny Mixtral (8 experts, top 2): the top-k activation term (issue 56)


@pytest.mark.parametrize("case", CASES, ids=[c.label for c in CASES])
def test_predicted_peak_within_15_percent(case: Case, tmp_path: Path) -> None:
    model_dir = write_model(case, tmp_path / "model")
    predicted = predict(case, model_dir)
    # One measurement: the S case's 58 against 69-71 MiB on other machines was the CPU, not noise (oneDNN's bf16
    # buffers exist only on AVX-512 CPUs; core/hostcpu.py), and the plan now follows it. On such a CPU glibc's
    # heap makes the S case's peak move between 61.7 and 68.4 MiB from run to run; the plan (67.4) was 73.0 while
    # it put 30 % slack on those buffers too, which are made once and kept (planner/moments.py).
    measured = measure(case, model_dir)["peak"]
    assert measured > 10 * 1024**2, "the measurement saw no training memory"
    message = f"predicted {predicted / 2**20:.1f} MiB, measured {measured / 2**20:.1f} MiB"
    assert abs(predicted - measured) <= 0.15 * measured, message
