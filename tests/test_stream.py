"""What `submit --wait` streams (views/stream.stream_line, reused by any command that follows a run): steps
with rounded losses, evaluations, checkpoints, stops, restarts, failures and the end."""

from __future__ import annotations

import json
from pathlib import Path

from fsdpjob.orchestrator.registry import JobRecord
from fsdpjob.orchestrator.views.follow import wait_for
from fsdpjob.orchestrator.views.stream import stream_line

TIMELINE = [
    {"event": "start", "time": 1, "restart": 0, "world_size": 2, "job_id": "7", "host": "h", "launch": 0},
    {"event": "data", "time": 2, "sequences": 10, "examples": 40},
    {"event": "ready", "time": 3, "step": 0, "setup_s": 2.0441},
    {"event": "metric", "time": 4, "step": 10, "loss": 2.3229605607160435, "tokens_per_s": 1234.56, "eta_s": 12.3},
    {"event": "checkpoint", "time": 5, "step": 20, "reason": "interval", "save_s": 0.4123},
    {"event": "metric", "time": 6, "step": 20, "eval_loss": 2.1000000001, "eval_tokens": 99, "eval_s": 0.5},
    {"event": "fault", "time": 7, "kind": "crash", "launch": 0, "reason": "the workers' step exited 1", "restart": True,
     "decision": "restart 1 of 2"},
    {"event": "start", "time": 8, "restart": 0, "world_size": 2, "host": "h", "launch": 1},
    {"event": "resume", "time": 9, "step": 20, "checkpoint": "/r/checkpoints/step-00000020"},
    {"event": "metric", "time": 10, "step": 30, "loss": None, "tokens_per_s": 1000.0},
    {"event": "stop", "time": 11, "reason": "cancelled", "step": 33, "requeued": False, "save_s": 0.31,
     "detail": "fsdpjob cancel: the workers stopped for good"},
    {"event": "done", "time": 12, "step": 40, "loss": 1.987654321},
]
LINES = [
    "[start] workers started (2 ranks on h)",
    "[ready] training from step 0 after 2.04 s of set-up",
    "step 10/40  loss 2.3230  1235 tok/s  eta 12 s",
    "[checkpoint] step 20 saved (interval, 0.41 s blocking)",
    "step 20/40  eval_loss 2.1000  (0.50 s)",
    "[fault] crash of launch 0: the workers' step exited 1; restarting: restart 1 of 2",
    "[start] workers started (2 ranks on h, restart 1 in this allocation)",
    "[resume] resumed from step 20 (/r/checkpoints/step-00000020)",
    "step 30/40  loss nan  1000 tok/s",  # metrics.jsonl writes a NaN loss as null
    "[stop] cancelled at step 33: stop checkpoint in 0.31 s; "
    "not requeued (fsdpjob cancel: the workers stopped for good)",
    "[done] finished at step 40, loss 1.9877",
]


def test_every_kind_of_entry_has_its_line_and_losses_are_rounded() -> None:
    assert [line for e in TIMELINE if (line := stream_line(e, 40)) is not None] == LINES


def test_wait_streams_the_whole_timeline_of_a_run_that_ended(tmp_path: Path, capsys) -> None:
    events = [e for e in TIMELINE if e["event"] != "metric"]
    metrics = [{k: v for k, v in e.items() if k != "event"} for e in TIMELINE if e["event"] == "metric"]
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    record = JobRecord(run_id="r-1", name="r", run_dir=str(tmp_path), scheduler="local", job_id="999999999",
                       profile="local", submitted_at=0.0, spec_hash="h", nodes=1, tasks_per_node=2, max_steps=40,
                       extra={"cancelled": True}, gpus_per_node=0)
    assert wait_for(record, poll_s=0.01) == 1
    out, err = capsys.readouterr()
    assert out.splitlines() == LINES
    assert err.startswith("r-1: CANCELLED at step 40/40")


def test_a_grpo_step_line_shows_its_mean_reward_its_std_and_the_completions_length() -> None:
    """Not its loss: 0 at a round's first step by construction (issue 53)."""
    line = stream_line({"event": "metric", "step": 5, "time": 1.0, "loss": 1e-9, "reward": 0.25, "reward_std": 0.4629,
                        "completions/mean_length": 11.25, "tokens_per_s": 400.0}, 60)
    assert line == "step 5/60  reward 0.2500 (std 0.4629)  length 11.2  400 tok/s", line


def test_a_pair_step_line_shows_the_accuracy_and_margin_beside_the_loss() -> None:
    line = stream_line({"event": "metric", "step": 3, "time": 1.0, "loss": 0.6921, "rewards/accuracies": 0.75,
                        "rewards/margins": 0.0123, "tokens_per_s": 50.0}, 16)
    assert line == "step 3/16  loss 0.6921  accuracy 0.75  margin 0.0123  50 tok/s", line


def test_the_reference_pass_is_streamed_with_its_rows_and_rate() -> None:
    lines = [stream_line({"event": "reference", "time": 1, "phase": "start", "rows": 40, "folder": "/r"}, 16),
             stream_line({"event": "reference", "time": 2, "phase": "stopped", "seconds": 1.5}, 16),
             stream_line({"event": "reference", "time": 3, "phase": "start", "rows": 40, "weights": "model.path"}, 16),
             stream_line({"event": "reference", "time": 4, "phase": "done", "rows": 40, "seconds": 2.0}, 16),
             stream_line({"event": "reference", "time": 5, "phase": "done", "rows": 10, "seconds": 0.5,
                          "table": "eval"}, 16)]
    assert lines == ["[reference] reference pass: 40 rows", "[reference] reference pass stopped after 1.50 s",
                     "[reference] reference pass: 40 rows (from model.path)",
                     "[reference] reference pass done: 40 rows in 2.00 s (20.0 rows/s)",
                     "[reference] reference pass of the eval rows done: 10 rows in 0.50 s (20.0 rows/s)"]


def test_a_run_that_failed_before_its_first_step_says_so(tmp_path: Path, capsys) -> None:
    """Not 'FAILED at step None/3' (issue 54, also found)."""
    events = [{"event": "start", "time": 1.0, "restart": 0, "world_size": 2},
              {"event": "failed", "time": 2.0, "rank": 0, "phase": "setup", "step": None, "error": "ValueError: x",
               "retryable": False}]
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    record = JobRecord(run_id="r-2", name="r", run_dir=str(tmp_path), scheduler="local", job_id="999999998",
                       profile="local", submitted_at=0.0, spec_hash="h", nodes=1, tasks_per_node=2, max_steps=3,
                       extra={}, gpus_per_node=0)
    assert wait_for(record, poll_s=0.01) == 1
    err = capsys.readouterr().err.splitlines()[-1]
    assert "before its first step" in err and "None" not in err, err
