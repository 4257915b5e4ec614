"""The run log (core/runfolder/runlog.py): one append, one timeline reader, and the guide's list of events."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from fsdpjob.orchestrator.core.runfolder import runlog

RUN_FOLDER_PAGE = Path(__file__).resolve().parents[1] / "docs" / "run-folder.md"


def test_the_guide_lists_exactly_the_events_runlog_knows():
    text = RUN_FOLDER_PAGE.read_text(encoding="utf-8")
    section = text.split("## Run log events", 1)[1].split("\n## ", 1)[0]
    listed = re.findall(r"^\| `(\w+)` \|", section, flags=re.M)
    assert listed == list(runlog.EVENTS)


def test_append_writes_one_line_per_event_and_refuses_unknown_names(tmp_path):
    runlog.append(tmp_path, runlog.START, restart=0)
    runlog.append(tmp_path, runlog.DONE, step=3)
    lines = (tmp_path / "events.jsonl").read_text().splitlines()
    assert [json.loads(line)["event"] for line in lines] == ["start", "done"]
    assert all({"time", "pid"} <= json.loads(line).keys() for line in lines)
    with pytest.raises(ValueError, match="unknown run event 'checkpointed'"):
        runlog.append(tmp_path, "checkpointed")


def test_timeline_merges_events_and_metrics_in_time_order_and_skips_a_line_being_written(tmp_path):
    (tmp_path / "events.jsonl").write_text(
        json.dumps({"event": "start", "time": 1}) + "\n" + json.dumps({"event": "done", "time": 4}) + "\n"
    )
    (tmp_path / "metrics.jsonl").write_text(
        json.dumps({"step": 1, "time": 2}) + "\n" + json.dumps({"step": 2, "time": 3}) + "\n" + '{"step": 3, "ti'
    )
    kinds = [(e["event"], e.get("step")) for e in runlog.timeline(tmp_path)]
    assert kinds == [("start", None), ("metric", 1), ("metric", 2), ("done", None)]
    assert [e["event"] for e in runlog.timeline(tmp_path, metrics=False)] == ["start", "done"]


def test_a_tail_read_drops_the_first_cut_line(tmp_path):
    for step in range(200):
        runlog.append_metric(tmp_path, {"step": step, "time": step})
    tail = runlog.read_metrics(tmp_path, max_bytes=300)
    assert tail and tail[-1]["step"] == 199 and all(set(m) == {"step", "time"} for m in tail)


def test_follower_returns_only_new_complete_entries(tmp_path):
    follow = runlog.Follower(tmp_path)
    assert follow.new_entries() == []
    runlog.append(tmp_path, runlog.START)
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 1, "time": 1e18')  # half a line: waits for its newline
    assert [e["event"] for e in follow.new_entries()] == ["start"]
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write("}\n")
    assert [(e["event"], e["step"]) for e in follow.new_entries()] == [("metric", 1)]
    assert follow.new_entries() == []


def test_first_and_since_are_the_two_queries_the_readers_share():
    timeline = [{"event": "start", "time": 1}, {"event": "checkpoint", "step": 2, "reason": "interval", "time": 2},
                {"event": "checkpoint", "step": 4, "reason": "final", "time": 3}, {"event": "done", "time": 4}]
    assert runlog.first(timeline, runlog.CHECKPOINT)["step"] == 2
    assert runlog.first(timeline, runlog.CHECKPOINT, reason="final")["step"] == 4
    assert runlog.first(timeline, runlog.STOP) is None
    assert [e["event"] for e in runlog.since(timeline, 3)] == ["checkpoint", "done"]
