"""The webhook transport of the batch side's notifications (notifier.py chooses what to tell): which URL a run
posts to, and one small JSON POST with bounded retries. A webhook that fails is retried a few times with short
timeouts and then given up: it can neither stop nor slow training. The URL is a secret (it carries its own
credentials): it is read from the environment sbatch exported, and never written to the run folder, the logs or
status.

urllib (the standard library) on purpose: the batch side's Python may lack requests, and one POST of a small
JSON body with a timeout needs nothing more.
"""

from __future__ import annotations

import json
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from fsdpjob.orchestrator.core import envvars
from fsdpjob.orchestrator.core.jobspec.notifyspec import NotifySpec, notify_of
from fsdpjob.orchestrator.core.runfolder.runmeta import RunMeta

TRIES = 3  # per event; then it is given up (and said so in the job's log, without the URL)
TIMEOUT_S = 5.0  # per try: a webhook endpoint answers in well under a second when it works
BACKOFF_S = (1.0, 2.0)  # between tries


def settings(run_dir: Path) -> tuple[NotifySpec, str] | None:
    """The run's notify section (spec over profile) and the webhook URL from the environment; None when the run
    has no webhook, or its variable is unset here (then a line in the log says so, without a value)."""
    meta = RunMeta.read(run_dir)
    spec_part, profile_part = meta.spec.get("notify"), meta.profile.get("notify")
    notify = notify_of(NotifySpec.model_validate(spec_part) if spec_part else None,
                       NotifySpec.model_validate(profile_part) if profile_part else None)
    if notify is None or not notify.webhook_url_env:
        return None
    url = envvars.named_by_user(notify.webhook_url_env)
    if not url:
        log(f"${notify.webhook_url_env} is not set in the job's environment: no webhook is sent")
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
            with urllib.request.urlopen(request, timeout=timeout_s) as response:  # the user's URL
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


def message(run: str, event: str, step: int | None, reason: str | None, goodput: float | None) -> dict:
    """The JSON body every notification has (docs/chains.md)."""
    return {"run": run, "event": event, "step": step, "reason": reason, "goodput": goodput,
            "time": round(time.time(), 3)}


def tell(notify: NotifySpec, run: str, event: str, *, step: int | None = None, reason: str | None = None,
         goodput: float | None = None) -> str | None:
    """One event that no run log holds (a sweep's sweep_done, from the code that sees the sweep end), posted now if
    ``notify`` chose it and its URL variable is set; returns why it was not delivered, or None."""
    if event not in notify.events or not notify.webhook_url_env:
        return None
    if not (url := envvars.named_by_user(notify.webhook_url_env)):
        return None
    return post(url, message(run, event, step, reason, goodput))


def log(text: str) -> None:
    print(f"fsdpjob notify: {text}", file=sys.stderr, flush=True)
