"""The rank-0 reporter: metrics.jsonl is strict JSON (no NaN), and TensorBoard scalars when it is installed."""

from __future__ import annotations

import json
import math

import pytest

from fsdpjob.jobs.metrics import Reporter

VALUES = {"loss": 2.5, "lr": 1e-3, "grad_norm": 0.7, "tokens_per_s": 1000.0, "mfu": math.nan, "peak_mem_mb": 10.0}


def strict_json(line: str) -> dict:
    def refuse(token: str):
        raise ValueError(f"non-standard JSON constant {token}")

    return json.loads(line, parse_constant=refuse)


def test_metrics_lines_are_strict_json_and_name_non_finite_values(tmp_path):
    reporter = Reporter(tmp_path, enabled=True, max_steps=4)
    reporter.step(1, VALUES, step_time_s=0.1)
    reporter.step(2, {**VALUES, "loss": math.inf}, step_time_s=0.1)
    reporter.close()
    first, second = map(strict_json, (tmp_path / "metrics.jsonl").read_text().splitlines())
    assert first["loss"] == 2.5 and first["mfu"] is None and first["nonfinite"] == ["mfu"]
    assert second["loss"] is None and second["nonfinite"] == ["loss", "mfu"]


def test_other_ranks_write_nothing(tmp_path):
    reporter = Reporter(tmp_path, enabled=False, max_steps=4)
    reporter.step(1, VALUES, step_time_s=0.1)
    reporter.event("start")
    reporter.close()
    assert list(tmp_path.iterdir()) == []


def test_tensorboard_scalars(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    reporter = Reporter(tmp_path, enabled=True, max_steps=4)
    for step in (1, 2, 3):
        reporter.step(step, {**VALUES, "loss": 3.0 - step}, step_time_s=0.1)
    reporter.close()
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("train/loss")] == [(1, 2.0), (2, 1.0), (3, 0.0)]
    assert "train/mfu" not in acc.Tags()["scalars"]  # NaN is not plotted
