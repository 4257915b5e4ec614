"""The run log's launches and attempts (core/attempts.py), and the one definition of "did it train"."""

from __future__ import annotations

from fsdpjob.orchestrator.core import attempts


def start(restart=0, launch=0, t=0.0):
    return {"event": "start", "restart": restart, "launch": launch, "time": t}


def test_a_launch_trained_only_with_a_logged_step_past_its_ready_step():
    assert attempts.trained([start(), {"event": "ready", "step": 4}, {"event": "metric", "step": 5}])
    assert not attempts.trained([start(), {"event": "ready", "step": 4}])  # crashed at its first step
    assert not attempts.trained([start(), {"event": "metric", "step": 5}])  # never got ready: not its line


def test_launches_cut_at_each_start_and_attempts_group_the_supervisors_restarts():
    timeline = [{"event": "cancel"}, start(), {"event": "ready", "step": 0}, start(launch=1), start(restart=1)]
    assert [len(launch) for launch in attempts.launches(timeline)] == [3, 1, 1]
    assert [(r, len(ev)) for r, ev in attempts.attempts(timeline)] == [(0, 3), (1, 1)]
    assert attempts.launches([]) == [[]]
    assert attempts.later_starts(timeline) == [start(launch=1), start(restart=1)]


def test_ever_trained_counts_a_metric_line_only_within_its_launch():
    trained = [start(), {"event": "ready", "step": 0}, {"event": "metric", "step": 1}]
    assert attempts.ever_trained(trained + [start(launch=1), {"event": "ready", "step": 1}])
    assert not attempts.ever_trained([start(), {"event": "ready", "step": 0}, start(launch=1)])


def test_stop_retry_and_cap_facts():
    assert attempts.requeued_after_stop({"event": "stop", "requeued": True})
    assert not attempts.requeued_after_stop({"event": "stop", "requeued": False})
    bad = {"event": "failed", "retryable": False, "error": "DataError: line 3"}
    assert attempts.not_retryable(bad) and attempts.not_retryable_why(bad) == "not retryable: DataError: line 3"
    assert not attempts.not_retryable({"event": "failed"})
    assert attempts.cap_reached(2, 3) is None
    assert attempts.cap_reached(3, 3) == "requeue cap reached: 3 restarts >= preemption.max_requeues (3)"
