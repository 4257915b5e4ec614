"""A worker whose fsdpjob or submitit is not the batch side's stops before it trains, with one line that says so
and a failure no restart retries (issue 36 item 7, C8: an image built from another checkout)."""

from __future__ import annotations

import json

import pytest
from distributed import run_ranks, train_worker
from test_resume import make_run

from fsdpjob.orchestrator.core.buildid import build_id, host_mismatch
from fsdpjob.orchestrator.core.runfolder import attempts

pytestmark = pytest.mark.distributed


def test_the_line_names_both_builds_and_the_same_build_passes() -> None:
    assert build_id().startswith("fsdpjob ") and ", submitit " in build_id()
    assert host_mismatch(None) is None and host_mismatch(build_id()) is None
    other = "fsdpjob 0.1.0 (sources 000000000000), submitit 1.5.1"
    line = host_mismatch(other)
    assert line and other in line and build_id() in line and "\n" not in line


def test_a_worker_of_another_build_fails_before_training_and_not_retryably(tmp_path) -> None:
    from fsdpjob.jobs.quickstart import make_quickstart

    run_dir = make_run(tmp_path, "other-build", make_quickstart(tmp_path / "assets"))
    env = {"FSDPJOB_HOST_BUILD": "fsdpjob 0.1.0 (sources 000000000000), submitit 1.5.1"}
    with pytest.raises(AssertionError, match="BuildMismatch"):
        run_ranks(train_worker, 1, run_dir=str(run_dir), env=env)
    events = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]
    [failed] = [e for e in events if e["event"] == "failed"]
    assert failed["error"].startswith("BuildMismatch: the workers run fsdpjob") and failed["retryable"] is False
    assert attempts.not_retryable(failed)
    assert not [e for e in events if e["event"] == "start"]  # stopped before anything else happened


def test_the_launch_ends_when_fsdpjob_first_runs_not_when_the_process_was_made(monkeypatch) -> None:
    """A runtime may prepare the container inside the task's process before it execs Python (pyxis's hooks
    importing an image; the real-cluster test's wrapper sleeps): /proc's creation time is then before that work,
    which is launch, not the worker's set-up (goodput's launch part)."""
    import time

    from fsdpjob.jobs import workerenv

    created = workerenv._created_at()
    assert created is not None and created <= time.time()
    monkeypatch.setattr(workerenv, "_ENTERED_AT", None)
    assert workerenv.process_started_at() == created  # not entered yet: the process's age
    monkeypatch.setattr(workerenv, "_ENTERED_AT", created + 119.0)  # entered two minutes after the exec's fork
    assert workerenv.process_started_at() == round(created + 119.0, 2)
    workerenv.entered()  # once only: the first call wins
    assert workerenv.process_started_at() == round(created + 119.0, 2)
