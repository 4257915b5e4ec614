"""Slurm output parsers and the scheduler views built from them, on output recorded from the real
dev cluster (Slurm 22.05, tests/data/slurm-22.05/). Only interfaces stable from 22.05 to 25.x are read:
`sacct --parsable2`, squeue with an explicit -o format, `scontrol show job|node` key=value pairs."""

from __future__ import annotations

from pathlib import Path

import pytest

from fsdpjob.orchestrator.slurm import commands as slurm_cli
from fsdpjob.orchestrator.slurm.backend import view_from_scontrol, views_from_sacct, views_from_squeue
from fsdpjob.orchestrator.views.progress import Progress
from fsdpjob.orchestrator.views.status import phase_of

RECORDED = Path(__file__).parent / "data" / "slurm-22.05"


def recorded(name: str) -> str:
    return (RECORDED / name).read_text()


def test_sacct_skips_job_steps_and_keeps_one_row_per_run():
    rows = slurm_cli.parse_sacct(recorded("sacct-with-steps.txt"))
    assert [(r.job_id, r.state) for r in rows] == [("64", "REQUEUED")] * 3 + [("64", "COMPLETED")]
    assert rows[0].nodes == "n[1-2]" and rows[0].elapsed == "00:00:57"


def test_sacct_views_count_restarts_and_take_the_latest_state():
    views = views_from_sacct(slurm_cli.parse_sacct(recorded("sacct-requeued-and-failed.txt")))
    # three time-limit requeues, then the run that finished
    assert views["64"].state == "COMPLETED" and views["64"].restarts == 3
    assert views["63"].state == "FAILED" and views["63"].restarts == 0
    assert phase_of(views["64"].state, views["64"].restarts, Progress()) == "COMPLETED"


@pytest.mark.parametrize("line", [
    "",
    "garbage without separators",
    "12|name|RUNNING",  # too few fields (a different -o): skipped, never an IndexError
])
def test_sacct_tolerates_lines_it_did_not_ask_for(line):
    assert slurm_cli.parse_sacct(line) == []


def test_sacct_state_words_of_newer_slurm_map_to_phases():
    # 23.x-25.x print "CANCELLED by <uid>" and use OUT_OF_MEMORY/NODE_FAIL; the first word decides.
    rows = slurm_cli.parse_sacct("7|j|CANCELLED by 1000|0:0|a|b|n1|00:00:01\n8|j|OUT_OF_MEMORY|0:125|a|b|n1|00:00:01\n")
    views = views_from_sacct(rows)
    assert phase_of(views["7"].state, 0, Progress()) == "CANCELLED"
    assert phase_of(views["8"].state, 0, Progress()) == "FAILED"


def test_squeue_views_read_state_reason_and_nodes():
    views = views_from_squeue(slurm_cli.parse_squeue(recorded("squeue.txt")))
    assert views["67"].state == "COMPLETED" and views["67"].nodes == "n[1-2]"
    assert views["68"].state == "PENDING" and views["68"].reason is None and views["68"].nodes is None


def test_scontrol_show_job_of_a_requeued_pending_job():
    info = slurm_cli.parse_scontrol(recorded("scontrol-show-job-pending.txt"))
    view = view_from_scontrol(info)
    assert (view.state, view.restarts, view.reason, view.nodes) == ("PENDING", 2, None, None)
    assert phase_of(view.state, view.restarts, Progress()) == "REQUEUED"
    assert info["TimeLimit"] == "00:10:00" and info["Requeue"] == "1"


def test_scontrol_show_node_gives_the_node_address():
    info = slurm_cli.parse_scontrol(recorded("scontrol-show-node.txt"))
    assert info["NodeName"] == "n1" and info["NodeAddr"] == "127.0.0.1"



def slurm_record(run_dir: Path, **extra_fields):
    from fsdpjob.orchestrator.registry import JobRecord

    return JobRecord(run_id="r-1", name="r", run_dir=str(run_dir), scheduler="slurm", job_id="9", profile="p",
                     submitted_at=0.0, spec_hash="h", nodes=2, tasks_per_node=2, max_steps=40, **extra_fields)

@pytest.mark.parametrize("cancelled, phase", [(True, "CANCELLED"), (False, "UNKNOWN")])
def test_a_job_slurmctld_forgot_is_cancelled_if_fsdpjob_cancelled_it(tmp_path, cancelled, phase):
    # No accounting: after MinJobAge neither squeue nor scontrol knows the job (view None); the worker
    # may have died before writing anything, so only the record's cancel mark tells.
    from fsdpjob.orchestrator.views.status import build_report

    record = slurm_record(tmp_path, extra={"cancelled": True} if cancelled else {})
    assert build_report(record, None).phase == phase


def test_status_json_keys_are_the_documented_ones_and_name_the_last_stop(tmp_path):
    import json

    from fsdpjob.orchestrator.backend import SchedView
    from fsdpjob.orchestrator.views.status import STATUS_KEYS, build_report

    (tmp_path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in [
        {"event": "start", "restart": 0, "time": 1}, {"event": "ready", "step": 0, "time": 2},
        {"event": "stop", "reason": "requeue", "step": 9, "requeued": True, "detail": "x", "time": 3},
        {"event": "start", "restart": 1, "time": 4}, {"event": "resume", "step": 9, "time": 5},
    ]))
    record = slurm_record(tmp_path)
    report = build_report(record, SchedView(state="RUNNING", restarts=1)).to_json()
    assert tuple(report) == STATUS_KEYS
    assert report["last_stop"] == {"reason": "requeue", "step": 9, "requeued": True}
    assert (report["restarts"], report["steps_lost"], report["phase"]) == (1, 0, "RUNNING")


def test_status_shows_what_the_packing_did_with_the_data(tmp_path):
    import json

    from fsdpjob.orchestrator.backend import SchedView
    from fsdpjob.orchestrator.views.display import status_text
    from fsdpjob.orchestrator.views.status import build_report

    data = {"event": "data", "sequences": 120, "examples": 400, "truncated": 0, "split": 3, "dropped": 0,
            "packing_efficiency": 0.9731, "cached": False, "seconds": 1.5, "time": 2}
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in [
        {"event": "start", "restart": 0, "time": 1}, data, {"event": "ready", "step": 0, "time": 3}]))
    report = build_report(slurm_record(tmp_path), SchedView(state="RUNNING"))
    assert report.to_json()["data"] == {k: data[k] for k in ("sequences", "examples", "truncated", "split",
                                                             "dropped", "packing_efficiency")}
    assert "data       400 examples in 120 sequences, 97.3% real tokens; longer than seq_len: 3 split" in (
        status_text(report))


def test_sinfo_node_lines_count_each_partitions_nodes_and_name_the_default():
    # `sinfo --Node --format %N|%P`: a node once per partition it is in; the default partition marked with '*'.
    text = "n1|debug*\nn1|high\nn2|debug*\nn2|high\ngpu07|big\n\nmalformed\n"
    assert slurm_cli.parse_partition_sizes(text) == ({"debug": 2, "high": 2, "big": 1}, "debug")
    assert slurm_cli.parse_partition_sizes("") == ({}, None)


def test_nodes_over_what_sinfo_counted_are_refused_and_a_profile_limit_still_wins():
    """The pure check takes sinfo's answer as a value (commands.partition_size asks it): above it, one line for
    resources.nodes naming the partition, its count and the fix; no answer (Slurm not reachable): no refusal."""
    from specs import build, job_spec

    from fsdpjob.orchestrator.core.jobspec.profiles import load_profile
    from fsdpjob.orchestrator.planner.resolve import problems

    spec = job_spec(build({"name": "n", "model": {"path": "m"}, "data": {"path": "d.jsonl"},
                           "train": {"max_steps": 5}, "resources": {"nodes": 3}}))
    cluster, example = load_profile("test-cluster"), load_profile("example")
    assert problems(spec, cluster, ("debug", 2)) == [(("resources", "nodes"), (
        "partition debug has 2 node(s) (sinfo): nodes must be at most 2, got 3; set resources.nodes to at most 2, "
        "or name a larger partition in resources.partition"))]
    assert problems(spec, cluster, ("debug", 3)) == [] and problems(spec, cluster, None) == []
    assert problems(spec, load_profile("local"), ("debug", 2))[0][1].startswith("the local profile runs on")
    tasks = {"resources": {"nodes": 3, "tasks_per_node": 8}}
    over = job_spec(build({"name": "n", "model": {"path": "m"}, "data": {"path": "d.jsonl"},
                           "train": {"max_steps": 5}}, **tasks))
    assert problems(over, example, ("gpu", 2))[0][1].startswith("partition gpu has 2 node(s) (sinfo)")
    assert problems(over.model_copy(update={"resources": over.resources.model_copy(update={"nodes": 65})}), example,
                    ("gpu", 100))[0][1].startswith("partition gpu of profile 'example' has 64 node(s)")
