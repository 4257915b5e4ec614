"""Plain-text tables for the terminal (rich when stdout is a terminal, aligned columns otherwise)."""

from __future__ import annotations

import sys


def table(headers: list[str], rows: list[list[str]]) -> str:
    if sys.stdout.isatty():
        from io import StringIO

        from rich.console import Console
        from rich.table import Table

        t = Table(*headers, box=None, pad_edge=False, header_style="bold")
        for row in rows:
            t.add_row(*[str(c) for c in row])
        buf = StringIO()
        Console(file=buf, force_terminal=True, width=200).print(t)
        return buf.getvalue().rstrip("\n")
    widths = [max(len(str(x)) for x in col) for col in zip(headers, *rows)] if rows else [len(h) for h in headers]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip() for r in [headers, *rows]]
    return "\n".join(lines)
