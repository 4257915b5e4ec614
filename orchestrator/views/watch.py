"""`status --watch` and `list --watch`: redraw a view in place (rich.live) until it says it is done, or Ctrl-C."""

from __future__ import annotations

import time
from collections.abc import Callable


def watch(draw: Callable[[], tuple[str, bool]], interval_s: float) -> None:
    """Call ``draw`` every ``interval_s`` seconds and show its text in place of the last one; stop after a draw
    that says it is done (the run ended) or on Ctrl-C, leaving the last text on the screen."""
    from rich.live import Live
    from rich.text import Text

    # auto_refresh off: the text changes only when drawn, so rich's own refresh thread would redraw for nothing.
    with Live(auto_refresh=False, vertical_overflow="visible") as live:
        try:
            while True:
                text, done = draw()
                live.update(Text.from_ansi(text), refresh=True)
                if done:
                    return
                time.sleep(interval_s)
        except KeyboardInterrupt:
            return  # the user has seen what they wanted; Ctrl-C ends the watch, not the run
