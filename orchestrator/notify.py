"""Webhook notifications from the batch side: the run log's events (start, requeue, fault, restart, done, failed)
as small JSON POSTs, sent by a background thread of the supervisor (and once by the failure policy after it),
never by the training step. A webhook that fails is retried a few times with short timeouts and then given up:
it can neither stop nor slow training. The URL is a secret (it carries its own credentials): it is read from the
environment sbatch exported, and never written to the run folder, the logs or status.

urllib (the standard library) on purpose: the batch side's Python may lack requests, and one POST of a small
JSON body with a timeout needs nothing more.
"""

from __future__ import annotations

import fcntl
import json
import os
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from fsdpjob.orchestrator.core import runlog
from fsdpjob.orchestrator.core.notifyspec import NotifySpec, notify_of
from fsdpjob.orchestrator.core.runmeta import RunMeta

TRIES = 3  # per event; then it is given up (and said so in the job's log, without the URL)
TIMEOUT_S = 5.0  # per try: a webhook endpoint answers in well under a second when it works
BACKOFF_S = (1.0, 2.0)  # between tries
POLL_S = 1.0  # how often the watcher reads the run log
CLOSE_BOUND_S = 20.0  # at the end, how long the last events may take to go out before the batch side moves on
TERMINAL = ("done", "failed")


def notifications(entry: dict) -> list[tuple[str, int | None, str | None]]:
    """(notify event, step, reason) for one run log event; empty for events nobody is told about.

    A rank's own `failed` event is not a verdict (the supervisor may restart it): the failure policy's is."""
    kind, step = entry.get("event"), entry.get("step")
    step = step if isinstance(step, int) else None
    if kind == runlog.START:
        return [("start", step, f"launch {entry.get('launch', 0)} of attempt {entry.get('restart', 0)}")]
    if kind == runlog.STOP and entry.get("requeued"):
        return [("requeue", step, str(entry.get("reason")))]
    if kind == runlog.REQUEUE:
        return [("requeue", step, str(entry.get("detail") or entry.get("reason")))]
    if kind == runlog.FAULT:
        found = [("fault", step, f"{entry.get('kind')}: {entry.get('reason')}")]
        return found + ([("restart", step, str(entry.get("decision")))] if entry.get("restart") else [])
    if kind == runlog.FAILED and "rank" not in entry:
        return [("failed", step, str(entry.get("reason")))]
    if kind == runlog.DONE:
        return [("done", step, None)]
    return []


def settings(run_dir: Path) -> tuple[NotifySpec, str] | None:
    """The run's notify section (spec over profile) and the webhook URL from the environment; None when the run
    has no webhook, or its variable is unset here (then a line in the log says so, without a value)."""
    meta = RunMeta.read(run_dir)
    spec_part, profile_part = meta.spec.get("notify"), meta.profile.get("notify")
    notify = notify_of(NotifySpec.model_validate(spec_part) if spec_part else None,
                       NotifySpec.model_validate(profile_part) if profile_part else None)
    if notify is None or not notify.webhook_url_env:
        return None
    url = os.environ.get(notify.webhook_url_env)
    if not url:
        _log(f"${notify.webhook_url_env} is not set in the job's environment: no webhook is sent")
        return None
    return notify, url


def post(url: str, payload: dict, *, tries: int = TRIES, timeout_s: float = TIMEOUT_S) -> str | None:
    """POST ``payload`` as JSON; None once delivered (any 2xx), else why not after ``tries`` (no URL in it)."""
    body = json.dumps(payload, sort_keys=True).encode()
    why = "not tried"
    for attempt in range(tries):
        request = urllib.request.Request(url, data=body, method="POST",
                                         headers={"Content-Type": "application/json", "User-Agent": "fsdpjob"})
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as response:  # noqa: S310 - the user's URL
                if 200 <= response.status < 300:
                    return None
                why = f"HTTP {response.status}"
        except urllib.error.HTTPError as exc:
            why = f"HTTP {exc.code}"
        except (urllib.error.URLError, OSError, ValueError) as exc:
            # URLError's reason is the socket's error ("Connection refused"), not the URL; ValueError: a bad URL.
            why = type(exc).__name__ + (f": {exc.reason}" if isinstance(exc, urllib.error.URLError) else "")
        if attempt + 1 < tries:
            time.sleep(BACKOFF_S[min(attempt, len(BACKOFF_S) - 1)])
    return why.replace(url, "<webhook>")


def payload(run_dir: Path, event: str, step: int | None, reason: str | None) -> dict:
    return {"run": run_dir.name, "event": event, "step": step, "reason": reason,
            "goodput": _goodput(run_dir) if event in TERMINAL else None, "time": round(time.time(), 3)}


def send(run_dir: Path, notify: NotifySpec, url: str, entries: list[dict]) -> None:
    """Tell about ``entries`` (run log events) that ``notify`` chose, in order; failures are logged, never raised.
    A sweep's task that ends here may be its last one: then sweep_done too."""
    for entry in entries:
        told = _send_entry(run_dir, notify, url, entry)
        end = next((event for event in told if event in TERMINAL), None)  # the run's end, not a rank's failure
        if end and (ended := sweep_ended(run_dir, end)):
            tell(notify, ended["name"], "sweep_done", reason=ended["reason"])


def _send_entry(run_dir: Path, notify: NotifySpec, url: str, entry: dict) -> list[str]:
    """Post what ``notify`` chose of one run log entry; returns the entry's notification events, chosen or not."""
    events = []
    for event, step, reason in notifications(entry):
        events.append(event)
        if event not in notify.events:
            continue
        why = post(url, payload(run_dir, event, step, reason))
        if why is not None:
            _log(f"webhook for event {event!r} not delivered after {TRIES} tries ({why}); giving up on it")
    return events


class Watcher:
    """The supervisor's background thread: tails the run log from now on and sends what it chose, in order."""

    def __init__(self, run_dir: Path, notify: NotifySpec, url: str):
        self.run_dir, self.notify, self.url = run_dir, notify, url
        self.follower = runlog.Follower(run_dir)
        self.follower.new_entries()  # earlier attempts' events were told about by then
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="fsdpjob-notify", daemon=True)

    def start(self) -> Watcher:
        self.thread.start()
        return self

    def _loop(self) -> None:
        while True:
            last = self.stopping.is_set()
            try:
                send(self.run_dir, self.notify, self.url, _events(self.follower.new_entries()))
            except Exception as exc:  # noqa: BLE001 - a notifier bug must never reach the supervisor
                _log(f"notifier error: {type(exc).__name__}")
            if last:
                return
            self.stopping.wait(POLL_S)

    def close(self, bound_s: float = CLOSE_BOUND_S) -> None:
        """Send what the run log got meanwhile (the done or the stop event), waiting at most ``bound_s``."""
        self.stopping.set()
        self.thread.join(bound_s)


def watch(run_dir: Path) -> Watcher | None:
    """Start the watcher for a run with a webhook; None without one (or on any problem: logged, never raised)."""
    try:
        found = settings(run_dir)
    except Exception as exc:  # noqa: BLE001 - notifications are never worth failing a job
        _log(f"notifications off: {type(exc).__name__}: {exc}")
        return None
    return Watcher(run_dir, *found).start() if found else None


def send_now(run_dir: Path, entry: dict, bound_s: float = CLOSE_BOUND_S) -> None:
    """Tell about one event written after the supervisor ended (the failure policy's requeue or failed), from a
    thread joined for at most ``bound_s``."""
    try:
        found = settings(run_dir)
    except Exception:  # noqa: BLE001
        return
    if found:
        thread = threading.Thread(target=send, args=(run_dir, *found, [entry]), daemon=True)
        thread.start()
        thread.join(bound_s)


def tell(notify: NotifySpec, run: str, event: str, *, step: int | None = None, reason: str | None = None,
         goodput: float | None = None) -> str | None:
    """One event that no run log holds (a sweep's sweep_done, from the code that sees the sweep end), posted now if
    ``notify`` chose it and its URL variable is set; returns why it was not delivered, or None."""
    if event not in notify.events or not notify.webhook_url_env or not (url := os.environ.get(notify.webhook_url_env)):
        return None
    return post(url, {"run": run, "event": event, "step": step, "reason": reason, "goodput": goodput,
                      "time": round(time.time(), 3)})


SWEEP_FILE = "sweep.json"  # orchestrator/sweepsubmit.py's, in the sweep's folder above its runs' folders
ENDED_FILE = "ended.json"  # beside it: run id -> how that task ended (done or failed), one writer at a time


def sweep_ended(run_dir: Path, outcome: str) -> dict | None:
    """Record that this run (a sweep's task) ended with ``outcome``; when that makes every task of the sweep ended,
    return {"name", "reason"} for sweep_done (exactly once: the tasks end on different nodes at any time, so the
    count is kept in one file under an exclusive lock). None for a run of no sweep, or while tasks still run."""
    sweep_dir = run_dir.parent
    try:
        sweep = json.loads((sweep_dir / SWEEP_FILE).read_text())
        runs = {r["run_id"] for r in sweep["runs"]}
    except (OSError, ValueError, KeyError, TypeError):
        return None  # not a sweep's task
    if run_dir.name not in runs:
        return None
    with open(sweep_dir / (ENDED_FILE + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        path = sweep_dir / ENDED_FILE
        ended = json.loads(path.read_text()) if path.exists() else {}
        was_complete = runs <= set(ended)
        ended[run_dir.name] = outcome
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(ended))
        tmp.replace(path)
    if was_complete or not runs <= set(ended):
        return None
    done = sum(1 for r in runs if ended[r] == "done")
    return {"name": sweep.get("name") or sweep_dir.name, "reason": f"{done} of {len(runs)} completed"}


def _events(entries: list[dict]) -> list[dict]:
    return [e for e in entries if e.get("event") != runlog.METRIC]


def _goodput(run_dir: Path) -> float | None:
    """The run's goodput so far from its own events (the status's number needs the scheduler's account)."""
    try:
        from fsdpjob.orchestrator.registry import JobRecord
        from fsdpjob.orchestrator.views.goodput import goodput

        meta = RunMeta.read(run_dir)
        eff = meta.effective
        record = JobRecord(run_id=run_dir.name, name=meta.spec.get("name", ""), run_dir=str(run_dir),
                           scheduler=eff.scheduler or "slurm", job_id="", profile=meta.profile.get("name", ""),
                           submitted_at=0.0, spec_hash=meta.spec_hash or "", nodes=eff.nodes or 1,
                           tasks_per_node=eff.tasks_per_node or 1, max_steps=meta.spec["train"]["max_steps"],
                           gpus_per_node=meta.profile.get("gpus_per_node"))
        value = goodput(record, None, runlog.read_events(run_dir), runlog.read_metrics(run_dir)).goodput
        return round(value, 4) if value is not None else None
    except Exception:  # noqa: BLE001 - a number in a message is not worth a failure
        return None


def _log(message: str) -> None:
    print(f"fsdpjob notify: {message}", file=sys.stderr, flush=True)
