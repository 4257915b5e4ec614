"""The run log's launches and attempts (core/runfolder/attempts.py), and the one definition of "did it train"."""

from __future__ import annotations

from fsdpjob.orchestrator.core.runfolder import attempts


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
    assert attempts.cap_reached(3, 3) is None
    assert "4 requeues in a row" in attempts.cap_reached(4, 3) and "max_requeues (3)" in attempts.cap_reached(4, 3)
    assert "never requeue" in attempts.cap_reached(0, 0)  # 0: requeue is off, healthy stops too


def _attempt(restart: int, *, trained: bool, failed: bool = False, stop: bool = False,
             saved: bool = False) -> list[dict]:
    events = [{"event": "start", "restart": restart, "launch": 0}, {"event": "ready", "step": 10 * restart}]
    events += [{"event": "metric", "step": 10 * restart + 5}] if trained else []
    events += [{"event": "checkpoint", "step": 10 * restart + 5}] if saved else []
    events += [{"event": "failed", "error": "boom"}] if failed else []
    return events + ([{"event": "stop", "reason": "preemption"}] if stop else [])


def test_only_requeues_that_signal_a_broken_job_count_against_the_cap():
    """Issue 36: time limits, preemptions and maintenance after progress are healthy and end the streak (a long
    run meets dozens), as does a failure after a committed checkpoint; attempts that kept nothing count, in a row."""
    healthy = [e for r in range(30) for e in _attempt(r, trained=True, stop=True)]
    # Thirty preemptions after progress: the 31st stop is still healthy (the old cap of 20 restarts failed here).
    assert attempts.unhealthy_streak(healthy + _attempt(30, trained=True), 30, ending_in_failure=False) == 0
    assert attempts.cap_reached(0, 20) is None
    # A crash before its first checkpoint counts, and so does each earlier one that kept nothing, in a row.
    crashes = healthy + _attempt(30, trained=True, failed=True) + _attempt(31, trained=False, stop=True)
    assert attempts.unhealthy_streak(crashes + _attempt(32, trained=True), 32, ending_in_failure=True) == 3
    assert attempts.unhealthy_streak(crashes + _attempt(32, trained=True), 32, ending_in_failure=False) == 0
    # A crash after a committed checkpoint kept its progress: the streak ends there.
    kept = healthy + _attempt(30, trained=True, failed=True, saved=True)
    assert attempts.unhealthy_streak(kept + _attempt(31, trained=True), 31, ending_in_failure=True) == 1
    # A stop before any progress is a requeue without progress.
    assert attempts.unhealthy_streak(healthy + _attempt(30, trained=False), 30, ending_in_failure=False) == 1
