"""Which crashed attempts are requeued (orchestrator/failure.py::decide), on recorded event timelines."""

from fsdpjob.orchestrator.failure import decide


def attempt(*events):
    return [{"event": "start", "time": 0}] + [dict(e, time=i + 1) for i, e in enumerate(events)]


def test_crash_after_progress_is_requeued():
    ok, why = decide(attempt({"event": "ready", "step": 10}, {"event": "metric", "step": 12}), restarts=0, max_requeues=3)
    assert ok, why


def test_crash_before_first_step_is_not_requeued():
    ok, why = decide(attempt({"event": "ready", "step": 0}), restarts=0, max_requeues=3)
    assert not ok and "before its first training step" in why
    ok, _ = decide(attempt(), restarts=0, max_requeues=3)  # died during setup (bad spec, OOM at load)
    assert not ok


def test_not_retryable_failure_is_not_requeued():
    events = attempt({"event": "ready", "step": 0}, {"event": "metric", "step": 5},
                     {"event": "failed", "retryable": False, "error": "DataError: bad line"})
    ok, why = decide(events, restarts=0, max_requeues=3)
    assert not ok and "DataError" in why


def test_cap_and_already_requeued():
    events = attempt({"event": "ready", "step": 0}, {"event": "metric", "step": 5})
    assert not decide(events, restarts=3, max_requeues=3)[0]
    stopped = events + [{"event": "stop", "requeued": True, "time": 99}]
    ok, why = decide(stopped, restarts=0, max_requeues=3)
    assert not ok and "already requeued" in why


def test_only_the_last_attempt_counts():
    old = attempt({"event": "ready", "step": 0}, {"event": "metric", "step": 50})
    new = [{"event": "start", "time": 100}, {"event": "ready", "step": 40, "time": 101}]
    assert not decide(old + new, restarts=1, max_requeues=5)[0]  # the new attempt made no step
