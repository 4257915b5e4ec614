"""Notifications without a cluster: the notify section (bad input, profile defaults), the webhook's retries and
bounds against a real local HTTP server (supervise/webhook.py), and the notifier's order (supervise/notifier.py).
The real run is tests/slurm/test_chains_slurm.py."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from helpers import fsdpjob

from fsdpjob.orchestrator.core.jobspec.notifyspec import NotifySpec, notify_of
from fsdpjob.orchestrator.core.runfolder import runlog
from fsdpjob.orchestrator.core.runfolder.paths import RunPaths
from fsdpjob.orchestrator.core.runfolder.runmeta import RunMeta
from fsdpjob.orchestrator.core.runfolder.sweepstate import SweepState, SweepTask
from fsdpjob.orchestrator.supervise import notifier, webhook

VALID = Path(__file__).resolve().parent / "data" / "specs" / "valid"


class Hook:
    """A local webhook endpoint (http.server in a thread) that records what it got; it answers the first
    ``failures`` requests with HTTP 500."""

    def __init__(self, failures: int = 0):
        self.got: list[dict] = []
        self.requests = 0
        hook = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # http.server's name
                body = self.rfile.read(int(self.headers["Content-Length"]))
                hook.requests += 1
                if hook.requests <= failures:
                    self.send_response(500)
                else:
                    hook.got.append(json.loads(body))
                    self.send_response(204)
                self.end_headers()

            def log_message(self, *args):  # quiet
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook/s3cr3t-token"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def hook():
    h = Hook()
    yield h
    h.close()


def test_unknown_event_names_the_field_and_the_known_ones(tmp_path):
    done = fsdpjob("validate", str(VALID / "single-node.yaml"), "--no-file-checks", "--set",
                   "notify.events=[start, finished]", env={"FSDPJOB_HOME": str(tmp_path)})
    assert done.returncode == 2
    line = done.stderr.strip()
    assert "notify.events.1" in line and "'finished'" in line and "sweep_done" in line and "\n" not in line


@pytest.mark.parametrize("field, value, said", [
    ("webhook_url_env", "https://hooks.example.org/T0/B1/x", "the NAME of an environment variable, not the URL"),
    ("webhook_url_env", "MY HOOK", "not an environment variable name"),
    ("mail", "a@b.org,c@d.org", "is not a mail address"),
    ("events", "[done, done]", "listed twice"),
])
def test_bad_notify_values_are_one_line(tmp_path, field, value, said):
    done = fsdpjob("validate", str(VALID / "single-node.yaml"), "--no-file-checks", "--set",
                   f"notify.{field}={value}", env={"FSDPJOB_HOME": str(tmp_path)})
    assert done.returncode == 2 and said in done.stderr and f"notify.{field}" in done.stderr
    assert "hooks.example.org" not in done.stderr or field != "webhook_url_env" or said in done.stderr


def test_an_unset_webhook_variable_is_refused_at_submit(monkeypatch):
    from fsdpjob.orchestrator.core.errors import InputError
    from fsdpjob.orchestrator.planner.jobload import check_environment, load_job

    monkeypatch.delenv("NO_SUCH_HOOK_VAR", raising=False)
    job = load_job(str(VALID / "single-node.yaml"), overrides=("notify.webhook_url_env=NO_SUCH_HOOK_VAR",),
                   check_files=False)
    with pytest.raises(InputError, match=r"notify.webhook_url_env: \$NO_SUCH_HOOK_VAR \(the webhook URL\) is not set"):
        check_environment(job.spec, job.profile, job.doc)
    monkeypatch.setenv("NO_SUCH_HOOK_VAR", "http://x")
    check_environment(job.spec, job.profile, job.doc)


def test_profile_defaults_merge_under_the_spec():
    profile = NotifySpec(mail="ops@example.org", webhook_url_env="SITE_HOOK", events=["failed"])
    spec = NotifySpec.model_validate({"events": ["done", "failed"]})
    merged = notify_of(spec, profile)
    assert (merged.mail, merged.webhook_url_env, merged.events) == ("ops@example.org", "SITE_HOOK", ["done", "failed"])
    assert notify_of(None, profile) == profile and notify_of(None, None) is None
    assert merged.mail_types() == ["END", "FAIL"]


def test_a_failing_webhook_is_retried_then_delivered():
    h = Hook(failures=2)
    try:
        assert webhook.post(h.url, {"event": "done"}) is None
        assert h.requests == 3 and h.got == [{"event": "done"}]
    finally:
        h.close()


def test_an_unreachable_webhook_gives_up_in_bounded_time_and_never_names_the_url():
    h = Hook()
    url = h.url
    h.close()  # nothing listens there any more
    started = time.monotonic()
    why = webhook.post(url, {"event": "done"})
    assert why is not None and "s3cr3t" not in why and "127.0.0.1" not in why
    assert time.monotonic() - started < webhook.TRIES * webhook.TIMEOUT_S + sum(webhook.BACKOFF_S)


def _run_folder(tmp_path: Path, events: list[str]) -> Path:
    run_dir = tmp_path / "hooked-20261203-120000-abcd"
    run_dir.mkdir()
    spec = {"name": "hooked", "train": {"max_steps": 4},
            "notify": {"webhook_url_env": "FSDPJOB_TEST_HOOK", "events": events}}
    RunMeta(spec=spec, profile={"name": "test-cluster", "notify": {"mail": "ops@example.org"}}).write(RunPaths(run_dir))
    return run_dir


def test_the_notifier_sends_the_chosen_events_in_order_and_only_new_ones(tmp_path, hook, monkeypatch, capsys):
    monkeypatch.setenv("FSDPJOB_TEST_HOOK", hook.url)
    run_dir = _run_folder(tmp_path, ["start", "fault", "restart", "done"])
    runlog.append(run_dir, runlog.DONE, step=1)  # an earlier attempt's: told about then
    told = notifier.start(run_dir)
    runlog.append(run_dir, runlog.START, restart=1, launch=0)
    runlog.append(run_dir, runlog.FAILED, rank=1, error="boom")  # a rank's: the supervisor decides
    runlog.append(run_dir, runlog.FAULT, kind="crash", reason="the workers' step exited 1", restart=True,
                  decision="restart 1 of 3", step=2)
    runlog.append(run_dir, runlog.CHECKPOINT, step=3)
    runlog.append(run_dir, runlog.STOP, reason="preemption", requeued=True, step=3)  # requeue: not chosen
    runlog.append(run_dir, runlog.DONE, step=4)
    told.close()
    assert [(p["event"], p["step"]) for p in hook.got] == [("start", None), ("fault", 2), ("restart", 2), ("done", 4)]
    assert hook.got[0]["run"] == run_dir.name and hook.got[1]["reason"] == "crash: the workers' step exited 1"
    assert set(hook.got[-1]) == {"run", "event", "step", "reason", "goodput", "time"}
    assert "s3cr3t" not in capsys.readouterr().err


def test_no_webhook_no_thread_and_an_unset_variable_is_said_without_a_value(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("FSDPJOB_TEST_HOOK", raising=False)
    assert notifier.start(_run_folder(tmp_path, ["done"])) is None
    assert "$FSDPJOB_TEST_HOOK is not set in the job's environment" in capsys.readouterr().err


def test_an_event_without_a_run_log_is_told_directly(hook, monkeypatch):
    """sweep_done comes from the code that sees a sweep end, not from one run's log."""
    monkeypatch.setenv("FSDPJOB_TEST_HOOK", hook.url)
    chosen = NotifySpec(webhook_url_env="FSDPJOB_TEST_HOOK", events=["sweep_done"])
    assert webhook.tell(chosen, "lr-sweep", "sweep_done", reason="3 of 3 completed") is None
    assert webhook.tell(chosen, "lr-sweep", "done") is None  # not chosen: nothing sent
    assert [(p["run"], p["event"], p["reason"]) for p in hook.got] == [("lr-sweep", "sweep_done", "3 of 3 completed")]


def test_the_last_task_of_a_sweep_to_end_tells_sweep_done_once(tmp_path, hook, monkeypatch):
    """Each task's batch side records its end in the sweep's folder; the one that ends it posts sweep_done."""
    monkeypatch.setenv("FSDPJOB_TEST_HOOK", hook.url)
    sweep_dir = tmp_path / "lr-sweep-20261203"
    sweep_dir.mkdir()
    runs = []
    for index in range(3):
        run_dir = _run_folder(sweep_dir, ["done", "failed", "sweep_done"]).rename(sweep_dir / f"lr-{index}")
        runs.append(run_dir)
    SweepState(id=sweep_dir.name, name="lr", job_id="7", array="0-2",
               runs=tuple(SweepTask(i, r.name, {"lr": i}) for i, r in enumerate(runs))).write(sweep_dir)
    chosen = NotifySpec(webhook_url_env="FSDPJOB_TEST_HOOK", events=["done", "failed", "sweep_done"])
    notifier.send(runs[0], chosen, hook.url, [{"event": "done", "step": 4}])
    notifier.send(runs[2], chosen, hook.url, [{"event": "failed", "step": 2, "reason": "boom"}])
    assert [p["event"] for p in hook.got] == ["done", "failed"]  # one task still runs
    notifier.send(runs[1], chosen, hook.url, [{"event": "done", "step": 4}])
    notifier.send(runs[1], chosen, hook.url, [{"event": "done", "step": 4}])  # told twice (a retry): no second one
    assert [p["event"] for p in hook.got] == ["done", "failed", "done", "sweep_done", "done"]
    assert hook.got[3]["run"] == "lr" and hook.got[3]["reason"] == "2 of 3 completed"
    assert notifier.sweep_ended(tmp_path / "alone", "done") is None  # a run of no sweep


def test_the_sweep_file_reads_back_what_was_written_and_refuses_a_stranger(tmp_path):
    """sweep.json crosses from `fsdpjob sweep` to each task's batch side: one typed module writes and reads it."""
    state = SweepState(id="lr-sweep-1", name="lr", job_id="7", array="0-1%1",
                       runs=(SweepTask(0, "lr-0", {"optim.lr": 0.1}), SweepTask(1, "lr-1", {"optim.lr": 0.2})))
    state.write(tmp_path)
    assert SweepState.read(tmp_path) == state and state.run_ids == {"lr-0", "lr-1"}
    (tmp_path / "sweep.json").write_text(json.dumps({"id": 3, "runs": [{"index": 0, "run_id": "x"}]}))
    with pytest.raises(ValueError, match="not a sweep's file"):
        SweepState.read(tmp_path)
