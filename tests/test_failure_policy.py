"""Which crashed attempts are requeued (supervise/failure.py::requeue_after_crash), on recorded event timelines."""

from fsdpjob.orchestrator.supervise.failure import requeue_after_crash


def attempt(restart, *events, t0=0):
    out = [{"event": "start", "restart": restart, "time": t0}]
    return out + [dict(e, time=t0 + i + 1) for i, e in enumerate(events)]


TRAINED = ({"event": "ready", "step": 0}, {"event": "metric", "step": 5})


def test_crash_after_progress_is_requeued():
    events = attempt(0, {"event": "ready", "step": 10}, {"event": "metric", "step": 12})
    ok, why = requeue_after_crash(events, restarts=0, max_requeues=3)
    assert ok, why


def test_first_attempt_crash_before_first_step_is_not_requeued():
    ok, why = requeue_after_crash(attempt(0, {"event": "ready", "step": 0}), restarts=0, max_requeues=3)
    assert not ok and "before its first training step" in why
    # died during setup (bad spec, OOM at load)
    assert not requeue_after_crash(attempt(0), restarts=0, max_requeues=3)[0]
    assert not requeue_after_crash([], restarts=0, max_requeues=3)[0]  # never even started


def test_not_retryable_failure_is_not_requeued():
    events = attempt(0, *TRAINED, {"event": "failed", "retryable": False, "error": "DataError: bad line"})
    ok, why = requeue_after_crash(events, restarts=0, max_requeues=3)
    assert not ok and "DataError" in why


def test_cap_and_already_requeued():
    assert not requeue_after_crash(attempt(3, *TRAINED), restarts=3, max_requeues=3)[0]
    stopped = attempt(0, *TRAINED, {"event": "stop", "requeued": True})
    ok, why = requeue_after_crash(stopped, restarts=0, max_requeues=3)
    assert not ok and "already requeued" in why


def test_setup_crash_after_earlier_progress_is_retried_a_bounded_number_of_times():
    earlier = attempt(0, *TRAINED)
    assert requeue_after_crash(earlier + attempt(1, t0=100), restarts=1, max_requeues=9)[0]
    assert requeue_after_crash(earlier, restarts=1, max_requeues=9)[0]  # killed before the new attempt wrote anything
    assert requeue_after_crash(earlier, restarts=2, max_requeues=9)[0]
    ok, why = requeue_after_crash(earlier, restarts=3, max_requeues=9)
    assert not ok and "in a row" in why


def test_the_requeue_event_records_the_step_the_crashed_attempt_reached(tmp_path, monkeypatch):
    # Outside a Slurm job the requeue itself cannot run: stop right before it and check the record.
    import json

    from fsdpjob.orchestrator.core.runfolder.paths import RunPaths
    from fsdpjob.orchestrator.core.runfolder.runmeta import RunMeta
    from fsdpjob.orchestrator.slurm import commands as slurm_cli
    from fsdpjob.orchestrator.slurm import failure

    RunMeta(spec={"preemption": {"max_requeues": 5}}).write(RunPaths(tmp_path))
    events = attempt(0, *TRAINED, t0=0) + attempt(1, {"event": "ready", "step": 5},
                                                   {"event": "checkpoint", "step": 8}, t0=100)
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    (tmp_path / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": s, "time": 100 + s}) + "\n" for s in (6, 9, 11)))
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    asked = []
    monkeypatch.setattr(slurm_cli, "requeue_unless_cancelled", lambda job_id: asked.append(job_id))
    assert failure.main([str(tmp_path), "1"]) == 0
    last = json.loads((tmp_path / "events.jsonl").read_text().splitlines()[-1])
    assert asked == ["77"] and last["event"] == "requeue" and last["step"] == 11 and last["exit_code"] == 1
