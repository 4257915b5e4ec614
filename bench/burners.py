"""CPU burners: plain busy processes beside a bench or a test run, to measure it on a loaded machine.

    python bench/burners.py 2 -- .ci/run      # the command beside 2 burners; they end with it
    with burning(4): ...                       # in a bench (recovery_soak.py --load 4)

Each burner is a Python process spinning in a loop with a deadline of its own (``max_s``), so one left behind by
a killed parent still ends; the context manager ends them (SIGKILL) when its block ends.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import subprocess
import sys
from collections.abc import Iterator

SPIN = "import time\nend = time.monotonic() + {max_s}\nwhile time.monotonic() < end:\n    pass\n"


@contextlib.contextmanager
def burning(n: int, max_s: float = 4 * 3600) -> Iterator[list[subprocess.Popen]]:
    procs = [subprocess.Popen([sys.executable, "-c", SPIN.format(max_s=max_s)]) for _ in range(n)]
    try:
        yield procs
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("n", type=int, help="how many burners")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND...: run it beside them")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to run beside the burners after --")
    # A SIGTERM (kill, a CI timeout) ends the command and the burners as the block's end does, never leaving
    # burners spinning for hours beside whatever runs next.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    with burning(args.n), subprocess.Popen(command) as child:
        try:
            return child.wait()
        finally:
            if child.poll() is None:
                child.terminate()


if __name__ == "__main__":
    sys.exit(main())
