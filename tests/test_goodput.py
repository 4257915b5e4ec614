"""Goodput breakdown (orchestrator/core/goodput/account.py, through views/goodput.py) over hand-built run
logs, and
scheduler times from sacct output recorded on the real dev cluster: every category, parts adding up to the
allocated time, interruptions and how they were recovered, the checkpoint interval advice."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from fsdpjob.orchestrator.backend import AttemptTimes
from fsdpjob.orchestrator.planner.interval import advise, current_interval, lost_per_hour
from fsdpjob.orchestrator.registry import JobRecord
from fsdpjob.orchestrator.slurm import commands as slurm_cli
from fsdpjob.orchestrator.slurm.backend import attempts_from_sacct, views_from_sacct
from fsdpjob.orchestrator.views.goodput import CATEGORIES, goodput

RECORDED = Path(__file__).parent / "data" / "slurm-22.05"


def record(submitted_at: float, gpus_per_node: int | None = 2, **kw) -> JobRecord:
    fields = {"run_id": "r-1", "name": "r", "run_dir": "/nonexistent", "scheduler": "slurm", "job_id": "9",
              "profile": "p", "submitted_at": submitted_at, "spec_hash": "h", "nodes": 1, "tasks_per_node": 2,
              "max_steps": 50, "gpus_per_node": gpus_per_node}
    return JobRecord(**{**fields, **kw})


def ev(event: str, time: float, **fields) -> dict:
    return {"event": event, "time": time, **fields}


def metric(step: int, time: float, loss: float = 1.0) -> dict:
    return {"step": step, "time": time, "loss": loss, "tokens_per_s": 100.0}


def assert_adds_up(rep) -> None:
    """Every attempt's parts (unexplained included) are its allocated seconds; the totals are their sum."""
    for a in rep.attempts:
        assert set(a.seconds) == set(CATEGORIES)
        assert sum(a.seconds.values()) == pytest.approx(a.allocated_s, abs=1e-6), a
        assert all(v >= 0 for v in a.seconds.values()), a
    assert sum(rep.unit_seconds.values()) == pytest.approx(rep.allocated_unit_s, abs=1e-6)


# A crash at step 43 of attempt 0 (a rank died: its peers fail, the failure policy requeues); attempt 1
# resumes from the step-20 checkpoint, so steps 21-43 were trained twice.
CRASH_EVENTS = [
    ev("start", 1015, restart=0), ev("data", 1020), ev("ready", 1030, step=0),
    ev("checkpoint", 1052, step=20, reason="interval", save_s=2.0),
    ev("failed", 1075, rank=1, error="RuntimeError: Connection closed by peer", step=43, retryable=True),
    ev("requeue", 1080, reason="failure", exit_code=1, step=43),
    ev("start", 1207, restart=1), ev("resume", 1215, step=20), ev("ready", 1216, step=20),
    ev("checkpoint", 1250, step=50, reason="final", save_s=3.0), ev("done", 1252, step=50),
]
CRASH_METRICS = [metric(10, 1040), metric(20, 1050), metric(30, 1062), metric(40, 1072),
                 metric(30, 1226), metric(40, 1236), metric(50, 1246)]
CRASH_ROWS = [AttemptTimes(1000, 1000, 1010, 1082, "REQUEUED"), AttemptTimes(1082, 1202, 1205, 1260, "COMPLETED")]


def test_the_launch_before_the_workers_process_is_its_own_part():
    # Issue 23: the workers' start event says when rank 0's process started; from the allocation's start to
    # there is the launch (batch script, supervisor, srun, a container's start), the rest of set-up start-up.
    events = [dict(e, process_started_at=1012.5) if e["event"] == "start" and e["restart"] == 0 else e
              for e in CRASH_EVENTS]
    rep = goodput(record(1000), CRASH_ROWS, events, CRASH_METRICS)
    assert_adds_up(rep)
    first, second = rep.attempts
    assert (first.seconds["launch"], first.seconds["startup"]) == pytest.approx((2.5, 17.5))
    assert (second.seconds["launch"], second.seconds["startup"]) == (0, 11)  # no process start recorded


def test_crash_loses_the_steps_beyond_the_checkpoint_the_next_attempt_resumed_from():
    rep = goodput(record(1000), CRASH_ROWS, CRASH_EVENTS, CRASH_METRICS)
    assert_adds_up(rep)
    first, second = rep.attempts
    assert first.seconds == pytest.approx({"launch": 0, "startup": 20, "reference": 0, "productive": 20,
                                           "checkpoint": 2, "lost": 23, "hang": 0, "teardown": 7, "unexplained": 0})
    assert second.seconds == pytest.approx({"launch": 0, "startup": 11, "reference": 0, "productive": 31,
                                            "checkpoint": 3, "lost": 0, "hang": 0, "teardown": 10, "unexplained": 0})
    assert (first.queue_wait_s, first.held_s, second.queue_wait_s, second.held_s) == (10, 0, 123, 120)
    assert (first.start_step, first.reached_step, second.start_step, second.reached_step) == (0, 43, 20, 50)
    [cut] = rep.interruptions
    assert (cut.attempt, cut.kind, cut.step, cut.lost_steps, cut.lost_s) == (0, "crash", 43, 23, 23)
    assert cut.recovered == "requeued by the failure policy, resumed from step 20"
    # 2 GPUs: unit-seconds are twice the wall seconds
    assert (rep.units, rep.unit, rep.allocated_unit_s, rep.productive_unit_s) == (2, "GPU", 254, 102)
    assert rep.goodput == pytest.approx(51 / 127) and rep.ettr == pytest.approx(51 / 260)
    assert rep.source == "sacct" and rep.wall_s == 260 and rep.step_s == pytest.approx(1.0)


# A preemption at step 24: the workers save and requeue; the next attempt resumes from step 24 and loses nothing.
PREEMPT_EVENTS = [
    ev("start", 5, restart=0), ev("ready", 10, step=0),
    ev("checkpoint", 35.5, step=24, reason="stop", save_s=1.5),
    ev("stop", 36, reason="preemption", signal=12, step=24, requeued=True, save_s=2.0),
    ev("start", 160, restart=1), ev("resume", 165, step=24), ev("ready", 166, step=24),
    ev("checkpoint", 184, step=40, reason="final", save_s=1.0), ev("done", 185, step=40),
]
PREEMPT_METRICS = [metric(10, 20), metric(20, 30), metric(30, 172), metric(40, 182)]


def test_the_batch_side_counts_from_spec_json_what_the_views_count_from_the_record():
    """The notifier has no registry record: spec.json's facts give the same split (submit time aside)."""
    from fsdpjob.orchestrator.core.goodput import account
    from fsdpjob.orchestrator.core.runfolder.runmeta import EffectiveFacts, RunMeta

    meta = RunMeta(spec={"name": "r"}, profile={"gpus_per_node": 2},
                   effective=EffectiveFacts(nodes=1, tasks_per_node=2))
    batch = account.goodput(meta.run_facts("r-1"), None, CRASH_EVENTS, CRASH_METRICS)
    views = goodput(record(1000), None, CRASH_EVENTS, CRASH_METRICS)
    assert (batch.units, batch.unit, batch.source) == (views.units, views.unit, views.source) == (2, "GPU", "events")
    assert batch.unit_seconds == views.unit_seconds and batch.goodput == views.goodput is not None
    assert batch.submitted_at == 1015  # not known there: the first start stands in


def test_preemption_with_a_stop_checkpoint_loses_nothing_from_events_alone():
    rep = goodput(record(0, gpus_per_node=0), None, PREEMPT_EVENTS, PREEMPT_METRICS)
    assert_adds_up(rep)
    first, second = rep.attempts
    # Without the scheduler's times an attempt spans its first to its last entry.
    assert (first.start, first.end, second.start, second.end) == (5, 36, 160, 185)
    assert first.seconds == pytest.approx({"launch": 0, "startup": 5, "reference": 0, "productive": 24, "checkpoint": 2,
                                           "lost": 0, "hang": 0, "teardown": 0, "unexplained": 0})
    assert second.seconds["productive"] == pytest.approx(17) and second.seconds["checkpoint"] == pytest.approx(1)
    assert (first.queue_wait_s, second.queue_wait_s) == (5, 124)
    [cut] = rep.interruptions
    assert (cut.kind, cut.step, cut.lost_steps, cut.lost_s) == ("preemption", 24, 0, 0)
    assert cut.recovered == "requeued by the workers, resumed from step 24"
    assert (rep.units, rep.unit, rep.source) == (2, "CPU rank", "events")
    assert rep.goodput == pytest.approx(41 / 56)


def test_a_reference_pass_is_its_own_part_in_the_allocation_it_stopped_in_and_the_one_that_finished_it():
    """Preference training (jobs/preference/reference.py): a preemption inside the pass (its stop at step 0, no
    ready), then the next allocation finishes the pass and trains."""
    events = [ev("start", 5, restart=0), ev("data", 8), ev("reference", 10, phase="start", rows=96),
              ev("reference", 30, phase="stopped", seconds=20), ev("stop", 31, step=0, reason="preemption",
                                                                   save_s=0.5, requeued=True),
              ev("start", 100, restart=1), ev("data", 103), ev("reference", 104, phase="start", rows=96),
              ev("reference", 110, phase="done", seconds=6), ev("ready", 111, step=0),
              ev("checkpoint", 130, step=12, reason="final", save_s=1.0), ev("done", 131, step=12)]
    rep = goodput(record(0, gpus_per_node=0), None, events, [metric(6, 120), metric(12, 129)])
    assert_adds_up(rep)
    first, second = rep.attempts
    assert first.seconds["reference"] == pytest.approx(20) and first.seconds["productive"] == 0, first.seconds
    assert second.seconds["reference"] == pytest.approx(6) and second.seconds["startup"] == pytest.approx(5)
    assert second.seconds["productive"] == pytest.approx(18), second.seconds


def test_a_hang_counts_from_the_last_progress_to_the_timeout_and_an_eventless_allocation_is_unexplained():
    events = [
        ev("start", 10), ev("ready", 20, step=0), ev("checkpoint", 40, step=10, reason="interval", save_s=1.0),
        ev("failed", 400, rank=0, error="RuntimeError: [Gloo] Timed out waiting 300000ms for recv", step=15),
        ev("start", 560, restart=1), ev("ready", 570, step=10),
        ev("checkpoint", 600, step=20, reason="final", save_s=1), ev("done", 601, step=20),
    ]
    metrics = [metric(5, 30), metric(15, 50), metric(20, 598)]
    rows = [AttemptTimes(0, 0, 5, 410, "FAILED"), AttemptTimes(410, 530, 530, 540, "NODE_FAIL"),
            AttemptTimes(540, 550, 555, 605, "COMPLETED")]
    rep = goodput(record(0), rows, events, metrics)
    assert_adds_up(rep)
    hung, dead, _ = rep.attempts
    assert hung.seconds["hang"] == pytest.approx(350) and hung.seconds["lost"] == pytest.approx(10)
    assert dead.seconds["unexplained"] == pytest.approx(10) and dead.allocated_s == 10
    assert [(c.kind, c.lost_steps) for c in rep.interruptions] == [("hang", 5), ("node_fail", 0)]
    assert rep.interruptions[0].lost_s == pytest.approx(360)
    assert rep.interruptions[1].recovered == "requeued, resumed from step 10"


def test_a_live_run_counts_up_to_now_and_a_cancelled_one_keeps_only_committed_steps():
    live = goodput(record(0, gpus_per_node=0), None, [ev("start", 2), ev("ready", 4, step=0)], [metric(10, 14)], now=20)
    assert live.attempts[0].end == 20 and live.interruptions == [] and live.wall_s == 20
    assert live.attempts[0].seconds["productive"] == pytest.approx(10)  # trained up to the last step seen
    assert live.attempts[0].seconds["teardown"] == pytest.approx(6)  # since then: not yet known
    failed = goodput(record(0, gpus_per_node=0), None, [
        ev("start", 2), ev("ready", 4, step=0), ev("checkpoint", 10, step=5, reason="interval", save_s=1),
        ev("failed", 20, rank=0, error="ValueError: bad", step=9, retryable=False)], [])
    [cut] = failed.interruptions
    assert (cut.kind, cut.lost_steps, cut.recovered) == ("crash", 4, "not recovered: the run ended here")
    assert failed.attempts[0].seconds["lost"] == pytest.approx(10)


def test_a_cancel_is_no_crash_and_gives_no_interval_advice_even_when_it_lost_work():
    """A cancel whose workers were killed before a stop checkpoint lost steps, but it was the user's choice."""
    from fsdpjob.orchestrator.views.report.run import interval_advice

    rep = goodput(record(0, gpus_per_node=0), None, [
        ev("start", 2), ev("ready", 4, step=0), ev("checkpoint", 10, step=5, reason="interval", save_s=1),
        ev("cancel", 20, by="fsdpjob cancel")], [metric(9, 19)])
    [cut] = rep.interruptions
    assert (cut.kind, cut.lost_steps, cut.recovered) == ("cancel", 4, "the run ended here, as cancelled")
    advice, note = interval_advice(rep, None)
    assert advice is None and note.startswith("no interruption lost work"), note


RECORDED_EVENTS = "sacct-preempted-run.txt"


def test_requeue_wait_from_recorded_sacct_rows():
    # A fsdpjob run on the dev cluster, preempted by a high-tier job and requeued; the test lifted the
    # BeginTime hold a few seconds after the requeue.
    rows = slurm_cli.parse_sacct((RECORDED / "sacct-preempted-run.txt").read_text())
    times = attempts_from_sacct(rows)
    assert set(times) == {rows[0].job_id}
    first, second = times[rows[0].job_id]
    ts = slurm_cli.slurm_timestamp
    assert first.state in ("PREEMPTED", "REQUEUED") and second.state == "COMPLETED"
    assert second.queued_at == ts(rows[1].submit) and second.queued_at >= first.end
    assert second.eligible_at > second.queued_at  # the hold after the requeue
    views = views_from_sacct(rows)
    assert views[rows[0].job_id].attempts == times[rows[0].job_id] and views[rows[0].job_id].restarts == 1
    # Events of the run, placed in the recorded allocations: a stop at step 10, resumed from step 10. As in
    # the real run, sacct ends the preempted row at the preemption, and the workers' stop save ends 6 s later.
    s0, s1 = first.start, second.start
    events = [ev("start", s0 + 4), ev("ready", s0 + 12, step=0),
              ev("stop", first.end + 6, reason="preemption", step=10, requeued=True, save_s=2.0),
              ev("start", s1 + 4, restart=1), ev("ready", s1 + 12, step=10),
              ev("checkpoint", second.end - 2, step=60, reason="final", save_s=1.0),
              ev("done", second.end - 1, step=60)]
    rep = goodput(record(first.queued_at, nodes=2), list(times[rows[0].job_id]), events, [])
    assert_adds_up(rep)
    assert rep.attempts[1].queue_wait_s == second.start - second.queued_at > 0
    assert rep.attempts[1].held_s == second.eligible_at - second.queued_at
    assert rep.attempts[0].seconds["startup"] == 12 and rep.attempts[0].seconds["checkpoint"] == 2
    assert rep.attempts[0].end == first.end + 6  # the nodes were held until the stop save was done
    assert [(c.kind, c.lost_steps) for c in rep.interruptions] == [("preemption", 0)]
    assert rep.units == 4 and json.loads(json.dumps(rep.to_json()))["attempts"][1]["state"] == "COMPLETED"


def test_sacct_time_fields_parse_and_older_recordings_still_read():
    assert slurm_cli.slurm_timestamp("Unknown") is None and slurm_cli.slurm_timestamp("") is None
    old = slurm_cli.parse_sacct((RECORDED / "sacct-requeued-and-failed.txt").read_text())
    assert old[0].submit == "" and attempts_from_sacct(old)["63"][0].queued_at is None


def test_young_daly_interval_and_what_a_setting_costs():
    a = advise(save_s=20, mtbi_s=8 * 3600, current_s=1800, current_note="interval_minutes 30")
    assert a.optimal_s == pytest.approx(math.sqrt(2 * 20 * 8 * 3600))
    assert a.lost_per_hour_optimal_s < a.lost_per_hour_current_s
    assert a.lost_per_hour_current_s == pytest.approx(lost_per_hour(1800, 20, 8 * 3600))
    # the optimum is the minimum of the cost
    assert lost_per_hour(a.optimal_s * 1.1, 20, 8 * 3600) > a.lost_per_hour_optimal_s
    assert lost_per_hour(60, 0.1, 10 * 3600) == pytest.approx(3600 * (0.1 / 60 + 60 / (2 * 36000)), rel=1e-3)
    assert lost_per_hour(600, 1, 60) == pytest.approx(3600)  # far past the MTBI: the whole hour, never more
    assert current_interval(50, 30, 2.0, 3600) == (100.0, "interval_steps 50 x 2 s")
    assert current_interval(0, 0, None, 3600)[0] == 3600


def test_plot_without_matplotlib_says_how_to_install_it(tmp_path):
    import subprocess
    import sys

    code = ("import sys; sys.modules['matplotlib'] = None\n"
            "from fsdpjob.orchestrator.cli import main\n"
            f"main(['report', 'any-run', '--plot', {str(tmp_path / 'x.png')!r}])")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2, done.stderr
    assert "pip install 'fsdpjob[plot]'" in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "x.png").exists()


def test_plan_prints_the_young_daly_interval_when_the_profile_states_an_interruption_rate(tmp_path):
    from fsdpjob.orchestrator.core.jobspec.profiles import load_profile
    from fsdpjob.orchestrator.core.jobspec.spec import JobSpec
    from fsdpjob.orchestrator.planner.fit import make_plan
    from fsdpjob.orchestrator.planner.resolve import resolve
    from fsdpjob.orchestrator.views.plan import format_plan

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 32000, "hidden_size": 4096,
        "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
        "max_position_embeddings": 4096, "tie_word_embeddings": False, "torch_dtype": "bfloat16"}))
    spec = JobSpec.model_validate({"name": "p", "model": {"path": str(model)}, "data": {"path": "d.jsonl"},
                                   "train": {"max_steps": 100}, "resources": {"nodes": 2},
                                   "checkpoint": {"interval_minutes": 60}})
    profile = load_profile("example")
    assert profile.expected_interruptions_per_day == 0.05  # documented there
    plan = make_plan(resolve(spec, profile))
    out = plan.to_json()["checkpoint_interval"]
    mtbi = 86400 / (0.05 * 2)  # per node and day, 2 nodes
    assert out["mtbi_s"] == pytest.approx(mtbi) and out["save_s"] == pytest.approx(plan.timing.save_s)
    assert out["optimal_s"] == pytest.approx(math.sqrt(2 * plan.timing.save_s * mtbi))
    assert out["current_s"] == 3600 and out["lost_per_hour_current_s"] > out["lost_per_hour_optimal_s"]
    assert "Young/Daly" in format_plan(plan)
    quiet = make_plan(resolve(spec, profile.model_copy(update={"expected_interruptions_per_day": None})))
    assert quiet.to_json()["checkpoint_interval"] is None and "Young/Daly" not in format_plan(quiet)


def test_the_step_is_measured_when_every_logged_window_holds_a_save():
    """A resumed run that saves more often than it logs (interval_steps 5, log_every 10): every window between
    progress points holds a save. Without the saves' blocking time each window is one step time per step."""
    events = [ev("start", 5), ev("resume", 9.5, step=100), ev("ready", 10, step=100),
              ev("checkpoint", 15.5, step=105, reason="interval", save_s=0.5),
              ev("checkpoint", 26, step=115, reason="interval", save_s=0.5),
              ev("checkpoint", 36.5, step=125, reason="interval", save_s=0.5),
              ev("checkpoint", 42, step=130, reason="final", save_s=0.5), ev("done", 42.1, step=130)]
    metrics = [metric(110, 20.5), metric(120, 31), metric(130, 41.5)]
    rep = goodput(record(0, max_steps=130), [AttemptTimes(0, 0, 0, 43, "COMPLETED")], events, metrics)
    assert rep.step_s == pytest.approx(1.0)


def test_a_short_local_resumed_run_names_its_source_and_its_units_and_measures_its_step():
    """A 16 s run on 2 CPU ranks, resumed from step 150 of an earlier run, logging one line: times from the local
    processes (no sacct), rank-seconds named so and shown to a precision that fits, a measured step time."""
    from fsdpjob.orchestrator.views.display import goodput_line
    from fsdpjob.orchestrator.views.report.run import RunReport, format_report

    local = record(100, gpus_per_node=0, scheduler="local", max_steps=160)
    events = [ev("start", 101, process_started_at=100.5), ev("resume", 106, step=150), ev("ready", 106.2, step=150),
              ev("checkpoint", 115.5, step=160, reason="final", save_s=0.3), ev("done", 115.6, step=160, loss=0.5)]
    rep = goodput(local, [AttemptTimes(100, 100, 100, 116.2, "COMPLETED")], events, [metric(160, 115.2)])
    assert_adds_up(rep)
    assert (rep.source, rep.unit, rep.units, rep.allocated_unit_s) == ("local", "CPU rank", 2, pytest.approx(32.4))
    assert rep.step_s == pytest.approx(0.9)  # ready at step 150 -> the one line at step 160
    text = format_report(RunReport(rep, "COMPLETED", None, "no checkpoint save measured yet"))
    assert "attempt times from the local processes (from the submit to their last write)" in text
    assert "sacct" not in text and "allocated 32.4 CPU rank-seconds (2 CPU ranks x 16.2 s):" in text, text
    assert re.search(r"productive\s+18 CPU rank-s\s+55\.6 %", text), text
    assert re.search(r"checkpoint saves\s+0\.6 CPU rank-s\s+1\.9 %", text), text  # not "0 CPU rank-s 1.9 %"
    assert "measured: step 0.9 s, blocking save 0.3 s" in text
    headline = {"goodput": rep.goodput, "ettr": rep.ettr, "allocated_unit_s": rep.allocated_unit_s, "unit": rep.unit}
    assert goodput_line(headline, "r-1").startswith("goodput    55.6 % of 32.4 CPU rank-seconds allocated")


def test_grpo_splits_productive_time_into_generation_and_training_of_kept_steps_only():
    """grpo logs each logged step's generation seconds (since the previous logged step): the productive part is
    split by them, counting only steps a later start kept (the crashed attempt's steps 21-43 were redone)."""
    gen = {10: 4.0, 20: 4.0, 30: 4.0, 40: 4.0}
    metrics = [dict(m, generation_s=gen[m["step"]] if m["step"] in gen else 4.0) for m in CRASH_METRICS]
    rep = goodput(record(1000), CRASH_ROWS, CRASH_EVENTS, metrics)
    assert_adds_up(rep)
    # Kept: steps 10 and 20 of attempt 0 (it resumed from 20), and 30, 40, 50 of attempt 1: 5 x 4 s on 2 GPUs.
    assert rep.productive_split["generation"] == pytest.approx(5 * 4.0 * 2)
    assert sum(rep.productive_split.values()) == pytest.approx(rep.productive_unit_s)
    assert goodput(record(1000), CRASH_ROWS, CRASH_EVENTS, CRASH_METRICS).productive_split is None  # not grpo


def test_grpo_shows_its_generator_own_time_weight_sync_and_server_replacements_of_kept_steps():
    """Issue 52 item 6: the trainers' time on the generator is split into its own lines: waiting on generation, the
    weight sync before each round, and the lost vLLM servers replaced while they waited (the supervisor's `server`
    events of phase replaced, each with the logged step after it). A replacement in a step a later start redid
    (attempt 0's step 40) is lost work, not a generator line."""
    from fsdpjob.orchestrator.views.report.run import RunReport, format_report

    metrics = [dict(m, generation_s=4.0, scoring_s=0.5, weight_sync_s=0.25) for m in CRASH_METRICS]
    events = sorted([*CRASH_EVENTS,
                     ev("server", 1066, phase="replaced", start=2, took_s=3.0, reason="killed"),  # before step 40: lost
                     ev("server", 1230, phase="replaced", start=3, took_s=2.0, reason="frozen"),  # before step 40: kept
                     ev("server", 1240, phase="replaced", start=4, took_s=9.0, reason="frozen")],  # over its step's 4.5
                    key=lambda e: e["time"])
    rep = goodput(record(1000), CRASH_ROWS, events, metrics)
    assert_adds_up(rep)
    # Kept: steps 10, 20 of attempt 0 and 30, 40, 50 of attempt 1, each 4.5 s (0.25 of it the sync) on 2 GPUs.
    split = rep.productive_split
    assert list(split) == ["generation", "weight sync", "generator restarts", "training"]
    assert split["weight sync"] == pytest.approx(5 * 0.25 * 2)
    assert split["generator restarts"] == pytest.approx((2.0 + 4.25) * 2)  # the second capped at its step's wait
    assert split["generation"] == pytest.approx((5 * 4.5 - 5 * 0.25 - 6.25) * 2)
    assert sum(split.values()) == pytest.approx(rep.productive_unit_s)
    text = format_report(RunReport(rep, "COMPLETED", None, None))
    assert re.search(r"\n    weight sync\s+2\.5 GPU-s .* of productive", text), text
    assert re.search(r"\n    generator restarts\s+12\.5 GPU-s .* of productive", text), text
