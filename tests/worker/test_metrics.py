"""The rank-0 reporter: metrics.jsonl is strict JSON (no NaN), and TensorBoard scalars when it is installed."""

from __future__ import annotations

import json
import math
import time
from types import SimpleNamespace

import pytest
import torch

from fsdpjob.jobs.report import metrics
from fsdpjob.jobs.report.metrics import Reporter

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


def test_steps_are_logged_at_step_1_every_log_every_and_the_last_with_window_averages(tmp_path):
    reporter = Reporter(tmp_path, enabled=True, max_steps=7, log_every=3)
    reporter.begin_training(0, flops_per_token=1.0, device=torch.device("cpu"), world_size=1)
    for step in range(1, 8):
        reporter.on_step(step, Values(10, 1.0 / step), lr=1e-3, tokens_seen=10 * step)
    reporter.close()
    lines = [strict_json(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 3, 6, 7]
    assert [m["tokens"] for m in lines] == [10, 30, 60, 70]  # tokens seen, not the window's
    assert all(m["tokens_per_s"] > 0 and m["mfu"] == 0.0 for m in lines)  # no MFU peak on CPU


class Values:
    """A trained step's values as the loop hands them over (jobs/step.py StepValues); counts the reads."""

    reads = 0

    def __init__(self, tokens: int, loss: float, grad_norm: float = 0.5):
        self.tokens, self._loss, self.grad_norm = tokens, loss, grad_norm
        self.processed = tokens  # non-pad positions, what tokens_per_s counts: all of them here

    @property
    def loss(self) -> float:
        Values.reads += 1
        return self._loss

    def extra(self) -> dict[str, float]:
        return {}  # a method's own metrics: none for SFT


def test_only_logged_steps_read_the_loss(tmp_path):
    """Reading a step's loss is a collective and a host sync: the reporter does it at log steps only."""
    reporter = Reporter(tmp_path, enabled=True, max_steps=20, log_every=10)
    reporter.begin_training(0, flops_per_token=1.0, device=torch.device("cpu"), world_size=1)
    Values.reads = 0
    for step in range(1, 21):
        reporter.on_step(step, Values(10, 1.0), lr=1e-3, tokens_seen=10 * step)
    reporter.close()
    assert Values.reads == 3  # steps 1, 10 and 20


def test_a_resumed_window_starts_at_the_resumed_step(tmp_path, monkeypatch):
    reporter = Reporter(tmp_path, enabled=True, max_steps=10, log_every=5)
    clock = iter([100.0, 102.0, 102.0])
    monkeypatch.setattr(metrics, "time", SimpleNamespace(time=lambda: next(clock), strftime=time.strftime,
                                                         gmtime=time.gmtime))
    reporter.begin_training(4, flops_per_token=1.0, device=torch.device("cpu"), world_size=1)
    reporter.on_step(5, Values(10, 1.0), lr=1e-3, tokens_seen=50)
    reporter.close()
    (line,) = [strict_json(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    # One step in 2 s: 5 tok/s, and 5 steps left at 2 s each.
    assert line["step"] == 5 and line["tokens_per_s"] == 5.0 and line["eta_s"] == 10.0


def test_cpu_memory_figure_is_the_peak_rss_only():
    figures = metrics.memory_figures(torch.device("cpu"))
    assert list(figures) == ["peak_mem_mb"] and figures["peak_mem_mb"] > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_peaks_start_at_the_loop_and_reserved_and_device_used_are_logged(tmp_path):
    device = torch.device("cuda", torch.cuda.current_device())
    spike = torch.empty(256 * 2**20, dtype=torch.uint8, device=device)  # set-up's spike: 256 MiB
    del spike
    reporter = Reporter(tmp_path, enabled=True, max_steps=1)
    reporter.begin_training(0, flops_per_token=1.0, device=device, world_size=1)
    reporter.on_step(1, Values(10, 1.0), lr=1e-3, tokens_seen=10)
    reporter.close()
    line = strict_json((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    assert line["peak_mem_mb"] < 256
    assert line["peak_reserved_mb"] >= line["peak_mem_mb"] and line["device_used_mb"] >= line["peak_reserved_mb"]
