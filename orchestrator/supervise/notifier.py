"""Webhook notifications from the batch side: the run log's events (start, requeue, fault, restart, done, failed)
told as they come, by a background thread of the supervisor (``Notifier``, which follows the run log) and once
by the failure policy after it (``send_now``); never by the training step. A sweep's task that ends the sweep
also tells sweep_done (its end is counted in the sweep's folder, core/runfolder/sweepstate.py). The transport, its
retries and the URL's secrecy are webhook.py's.
"""

from __future__ import annotations

import threading
from pathlib import Path

from fsdpjob.orchestrator.core.goodput.account import goodput
from fsdpjob.orchestrator.core.jobspec.notifyspec import NotifySpec
from fsdpjob.orchestrator.core.runfolder import runlog, sweepstate
from fsdpjob.orchestrator.core.runfolder.runmeta import RunMeta

from . import webhook

POLL_S = 1.0  # how often the notifier reads the run log
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


def payload(run_dir: Path, event: str, step: int | None, reason: str | None) -> dict:
    return webhook.message(run_dir.name, event, step, reason, _goodput(run_dir) if event in TERMINAL else None)


def send(run_dir: Path, notify: NotifySpec, url: str, entries: list[dict]) -> None:
    """Tell about ``entries`` (run log events) that ``notify`` chose, in order; failures are logged, never raised.
    A sweep's task that ends here may be its last one: then sweep_done too."""
    for entry in entries:
        told = _send_entry(run_dir, notify, url, entry)
        end = next((event for event in told if event in TERMINAL), None)  # the run's end, not a rank's failure
        if end and (ended := sweep_ended(run_dir, end)):
            webhook.tell(notify, ended["name"], "sweep_done", reason=ended["reason"])


def _send_entry(run_dir: Path, notify: NotifySpec, url: str, entry: dict) -> list[str]:
    """Post what ``notify`` chose of one run log entry; returns the entry's notification events, chosen or not."""
    events = []
    for event, step, reason in notifications(entry):
        events.append(event)
        if event not in notify.events:
            continue
        why = webhook.post(url, payload(run_dir, event, step, reason))
        if why is not None:
            webhook.log(f"webhook for event {event!r} not delivered after {webhook.TRIES} tries ({why}); "
                        "giving up on it")
    return events


class Notifier:
    """The supervisor's background thread: follows the run log from now on and sends what it chose, in order."""

    def __init__(self, run_dir: Path, notify: NotifySpec, url: str):
        self.run_dir, self.notify, self.url = run_dir, notify, url
        self.follower = runlog.Follower(run_dir)
        self.follower.new_entries()  # earlier attempts' events were told about by then
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="fsdpjob-notify", daemon=True)

    def start(self) -> Notifier:
        self.thread.start()
        return self

    def _loop(self) -> None:
        while True:
            last = self.stopping.is_set()
            try:
                send(self.run_dir, self.notify, self.url, _events(self.follower.new_entries()))
            except Exception as exc:  # a notifier bug must never reach the supervisor
                webhook.log(f"notifier error: {type(exc).__name__}")
            if last:
                return
            self.stopping.wait(POLL_S)

    def close(self, bound_s: float = CLOSE_BOUND_S) -> None:
        """Send what the run log got meanwhile (the done or the stop event), waiting at most ``bound_s``."""
        self.stopping.set()
        self.thread.join(bound_s)


def start(run_dir: Path) -> Notifier | None:
    """Start the notifier for a run with a webhook; None without one (or on any problem: logged, never raised)."""
    try:
        found = webhook.settings(run_dir)
    except Exception as exc:  # notifications are never worth failing a job
        webhook.log(f"notifications off: {type(exc).__name__}: {exc}")
        return None
    return Notifier(run_dir, *found).start() if found else None


def send_now(run_dir: Path, entry: dict, bound_s: float = CLOSE_BOUND_S) -> None:
    """Tell about one event written after the supervisor ended (the failure policy's requeue or failed), from a
    thread joined for at most ``bound_s``."""
    try:
        found = webhook.settings(run_dir)
    except Exception:  # no readable webhook settings: nothing to send
        return
    if found:
        thread = threading.Thread(target=send, args=(run_dir, *found, [entry]), daemon=True)
        thread.start()
        thread.join(bound_s)


def sweep_ended(run_dir: Path, outcome: str) -> dict | None:
    """Record that this run (a sweep's task) ended with ``outcome``; when that makes every task of the sweep ended,
    return {"name", "reason"} for sweep_done (exactly once: core/sweepstate.record_end counts under a lock). None
    for a run of no sweep, or while tasks still run."""
    sweep_dir = run_dir.parent
    try:
        sweep = sweepstate.SweepState.read(sweep_dir)
    except (OSError, ValueError):
        return None  # not a sweep's task
    runs = sweep.run_ids
    if run_dir.name not in runs:
        return None
    before, ended = sweepstate.record_end(sweep_dir, run_dir.name, outcome)
    if runs <= set(before) or not runs <= set(ended):
        return None
    done = sum(1 for r in runs if ended[r] == "done")
    return {"name": sweep.name or sweep_dir.name, "reason": f"{done} of {len(runs)} completed"}


def _events(entries: list[dict]) -> list[dict]:
    return [e for e in entries if e.get("event") != runlog.METRIC]


def _goodput(run_dir: Path) -> float | None:
    """The run's goodput so far from its own events and spec.json (the status's number needs the scheduler's
    account, which the batch side does not ask for)."""
    try:
        facts = RunMeta.read(run_dir).run_facts(run_dir.name)
        value = goodput(facts, None, runlog.read_events(run_dir), runlog.read_metrics(run_dir)).goodput
        return round(value, 4) if value is not None else None
    except Exception:  # a number in a message is not worth a failure
        return None
