"""The picture of `fsdpjob report` (views/report/picture.py: what it shows; views/report/plot.py: the drawing)
over hand-built run logs: loss against step per attempt, progress against wall time, checkpoint and evaluation
marks, start-ups named, time units that fit the run, and each kind of stop drawn as what it was."""

from __future__ import annotations

import json

import pytest

from fsdpjob.orchestrator.backend import AttemptTimes
from fsdpjob.orchestrator.registry import JobRecord
from fsdpjob.orchestrator.views.goodput import goodput
from fsdpjob.orchestrator.views.report import plot
from fsdpjob.orchestrator.views.report.picture import picture, time_unit


def record(run_id: str = "r-1", gpus_per_node: int = 0) -> JobRecord:
    return JobRecord(run_id=run_id, name="r", run_dir="/nonexistent", scheduler="local", job_id="1", profile="local",
                     submitted_at=0.0, spec_hash="h", nodes=1, tasks_per_node=2, max_steps=20,
                     gpus_per_node=gpus_per_node)


def ev(event: str, time: float, **fields) -> dict:
    return {"event": event, "time": time, **fields}


def metric(step: int, time: float, loss: float) -> dict:
    return {"step": step, "time": time, "loss": loss, "tokens_per_s": 900.0}


def evaluation(step: int, time: float, loss: float) -> dict:
    return {"step": step, "time": time, "eval_loss": loss, "eval_tokens": 512, "eval_s": 0.2}


# A 16 s local run: preempted at step 8 (a stop save, requeued by the workers), resumed from step 8, then
# cancelled by the user at step 12 (`fsdpjob cancel`, a stop save with reason "cancelled").
EVENTS = [
    ev("start", 1.0, restart=0, process_started_at=0.5), ev("ready", 4.0, step=0, setup_s=3.0),
    ev("checkpoint", 6.2, step=5, reason="interval", save_s=0.2),
    ev("stop", 8.0, reason="preemption", signal="SIGUSR2", step=8, requeued=True, save_s=0.3),
    ev("start", 10.0, restart=1), ev("resume", 10.6, step=8), ev("ready", 11.0, step=8),
    ev("checkpoint", 13.2, step=10, reason="interval", save_s=0.2),
    ev("cancel", 14.0, by="fsdpjob cancel"),
    ev("stop", 15.5, reason="cancelled", signal="SIGINT", step=12, requeued=False, save_s=0.4),
]
METRICS = [metric(2, 4.8, 2.31), metric(4, 5.6, 2.2), evaluation(5, 6.0, 2.25), metric(6, 6.8, 2.1),
           metric(8, 7.6, 2.0), metric(9, 12.0, 1.98), evaluation(10, 13.0, 1.97), metric(11, 14.2, 1.9),
           metric(12, 15.0, 1.85)]


def report_json(events=EVENTS, metrics=METRICS, rec: JobRecord | None = None) -> dict:
    return json.loads(json.dumps(goodput(rec or record(), None, events, metrics).to_json()))


def test_time_units_fit_the_run_length():
    assert time_unit(16) == ("s", 1.0)
    assert time_unit(120) == ("s", 1.0)
    assert time_unit(45 * 60) == ("min", 60.0)
    assert time_unit(5 * 3600) == ("h", 3600.0)


@pytest.fixture(scope="module")
def short_run() -> tuple[dict, dict, bytes, dict]:
    """The 16 s run's report JSON, picture data, PNG and what was drawn (drawing takes a second or more)."""
    data = report_json()
    pic = picture(data, EVENTS, METRICS)
    return data, pic, *plot.png_bytes(pic)


def test_a_short_run_reads_in_seconds_with_attempts_start_ups_checkpoints_and_evaluations(short_run):
    assert plot.available()  # matplotlib comes with the test extra
    data, pic, png, drawn = short_run
    assert (pic["unit"], pic["unit_s"]) == ("s", 1.0)
    # Each start of the workers: its own loss curve, and its start-up from the allocation start to ready.
    assert [(c["label"], c["step"]) for c in pic["training"]] == [
        ("attempt 0", [2, 4, 6, 8]), ("attempt 1", [9, 11, 12])]
    assert [(s["label"], s["begin"], s["end"], s["ready_step"]) for s in pic["starts"]] == [
        ("attempt 0", 1.0, 4.0, 0), ("attempt 1", 10.0, 11.0, 8)]
    assert [(c["step"], c["reason"]) for c in pic["checkpoints"]] == [(5, "interval"), (10, "interval")]
    assert [(e["step"], e["loss"]) for e in pic["evaluations"]] == [(5, 2.25), (10, 1.97)]
    assert [(s["kind"], s["label"], s["step"]) for s in pic["stops"]] == [("preemption", "preempted", 8),
                                                                         ("cancel", "cancelled", 12)]

    assert png[:8] == b"\x89PNG\r\n\x1a\n" and 20_000 < len(png) < 2_000_000
    assert drawn["unit"] == "s" and drawn["curves"] == {"attempt 0": 4, "attempt 1": 3}
    assert (drawn["checkpoints"], drawn["evaluations"]) == ([5, 10], [5, 10])
    texts = drawn["texts"]
    for shown in ("loss against step", "step", "loss", "attempt 0", "attempt 1", "start-up", "checkpoint",
                  "evaluation (eval loss)", "preempted", "cancelled", "progress against wall time"):
        assert shown in texts, shown
    assert any(t.startswith("wall time since submit (s)") for t in texts), texts
    # The bar is the breakdown `report --json` prints.
    assert drawn["bar"] == pytest.approx({k: v / data["allocated_unit_s"] for k, v in data["unit_seconds"].items()})
    assert sum(drawn["bar"].values()) == pytest.approx(1.0)


def test_a_cancel_is_never_drawn_as_a_crash_and_each_kind_of_stop_has_its_own_mark(short_run):
    drawn = short_run[3]
    crash_color = plot.MARKERS["crash"][1]
    assert [(kind, color) for _, kind, color in drawn["stops"]] == [
        ("preemption", plot.MARKERS["preemption"][1]), ("cancel", plot.MARKERS["cancel"][1])]
    assert crash_color not in [color for *_, color in drawn["stops"]] and "crash" not in drawn["texts"]
    # The four stops a user tells apart look apart: shape and colour.
    kinds = ("crash", "preemption", "cancel", "time_limit")
    assert len({plot.MARKERS[k] for k in kinds}) == len({plot.MARKERS[k][1] for k in kinds}) == 4

    # The same run, but the first attempt crashed (no stop save) and the second hit its time limit.
    events = [e for e in EVENTS if e["event"] not in ("stop", "cancel")]
    events += [ev("failed", 8.0, rank=0, error="RuntimeError: CUDA error", step=8, retryable=True),
               ev("stop", 15.5, reason="time_limit", signal="SIGUSR2", step=12, requeued=False, save_s=0.4)]
    crashed = picture(report_json(events), events, METRICS)
    assert [(s["kind"], s["label"]) for s in crashed["stops"]] == [("crash", "crash"), ("time_limit", "time limit")]
    _, drawn = plot.png_bytes(crashed)
    assert [color for *_, color in drawn["stops"]] == [crash_color, plot.MARKERS["time_limit"][1]]
    assert "crash" in drawn["texts"] and "time limit" in drawn["texts"]


def test_a_restart_in_the_allocation_keeps_the_mark_of_what_stopped_the_workers():
    # A local run: one allocation (the controller's life) in which the workers started twice.
    rows = [AttemptTimes(queued_at=0.0, eligible_at=0.0, start=0.0, end=16.0, state="CANCELLED")]
    data = json.loads(json.dumps(goodput(record(), rows, EVENTS, METRICS).to_json()))
    pic = picture(data, EVENTS, METRICS)
    assert [(s["label"], s["begin"], s["end"]) for s in pic["starts"]] == [("attempt 0", 0.0, 4.0),
                                                                          ("attempt 0, restart 1", 10.0, 11.0)]
    assert [c["label"] for c in pic["training"]] == ["attempt 0", "attempt 0, restart 1"]
    assert [(s["kind"], s["label"]) for s in pic["stops"]] == [("preemption", "preempted, restarted in the allocation"),
                                                               ("cancel", "cancelled")]


def test_a_start_that_is_not_ready_yet_is_start_up_up_to_now():
    events = [ev("start", 1.0, restart=0)]
    pic = picture(json.loads(json.dumps(goodput(record(), None, events, [], now=30.0).to_json())), events, [])
    assert [(s["begin"], s["end"], s["ready"]) for s in pic["starts"]] == [(1.0, 30.0, None)]
    assert pic["training"] == [{"label": "attempt 0", "attempt": 0, "time": [], "step": [], "loss": [],
                                "tokens_per_s": []}]


def test_a_long_run_reads_in_hours_and_a_run_name_is_drawn_as_text():
    hour = 3600.0
    events = [ev("start", 60.0, restart=0), ev("ready", 600.0, step=0),
              ev("checkpoint", 2 * hour, step=1000, reason="interval", save_s=30.0),
              ev("checkpoint", 5 * hour, step=2500, reason="final", save_s=30.0), ev("done", 5 * hour, step=2500)]
    metrics = [metric(step, 600.0 + step * 7.0, 2.0 - step / 5000) for step in range(100, 2501, 100)]
    # "$" would start matplotlib's mathtext: a run name is the user's text and is drawn as it is.
    rec = record(run_id="my$run^_<b>-1")
    pic = picture(report_json(events, metrics, rec), events, metrics)
    assert pic["unit"] == "h" and pic["stops"] == []
    _, drawn = plot.png_bytes(pic)
    assert any(t.startswith("my$run^_<b>-1: goodput") for t in drawn["texts"])
    assert any(t.startswith("wall time since submit (h)") for t in drawn["texts"])
    assert drawn["curves"] == {"attempt 0": 25}
