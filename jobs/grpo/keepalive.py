"""The generation server's keep-alive (``X-Fsdpjob-Keepalive: SECONDS``, jobs/grpo/server.py): while the engine
makes progress, a space each period, after a 200 status sent with the first, so that a client's deadline bounds a
silence rather than the work."""

from __future__ import annotations

import threading
from http import HTTPStatus
from typing import Any


class Ticker:
    """Writes a space to an answer in the making each ``every_s`` in which the engine made progress, the 200
    status and headers before the first (no length: the answer ends when the connection closes)."""

    def __init__(self, handler: Any, every_s: float, progress: Any):  # server.Handler: its write_part
        self.handler, self.every_s, self.progress = handler, every_s, progress
        self.started = False  # the status is out: the rest of the answer is its body
        self.gone = False  # the client left
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="grpo-server keepalive", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        seen = self.progress()
        while not self._stop.wait(self.every_s):
            now = self.progress()
            if now == seen:  # no token decoded since the last tick: say nothing, so the client's deadline runs
                continue
            seen = now
            if not self.started:
                handler = self.handler
                handler.send_response(HTTPStatus.OK)
                handler.send_header("Content-Type", "application/json")
                handler.send_header("Connection", "close")
                handler.close_connection = True
                self.started = True
                try:
                    handler.end_headers()
                except (BrokenPipeError, ConnectionResetError):
                    self.gone = True
                    return
            if not self.handler.write_part(b" "):
                self.gone = True
                return

    def stop(self) -> None:
        """No write after this returns: the handler writes the rest."""
        self._stop.set()
        self._thread.join()


def keepalive_s(value: str | None) -> float | None:
    """The keep-alive period a client asked for, clamped to [0.05, 30] s; None when it asked for none."""
    try:
        seconds = float(value) if value else None
    except ValueError:
        return None
    return None if seconds is None or seconds != seconds else min(max(seconds, 0.05), 30.0)
