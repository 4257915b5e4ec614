"""Where a profiled run's time went, per training step: a py-spy raw profile folded under one frame.

    python bench/pyspy_breakdown.py PROFILE.txt --anchor "run (jobs/train.py" --steps 60 [--depth 2] [--ranks 2]

PROFILE.txt is what ``bench/worker_throughput.py --py-spy DIR`` records (``py-spy record --idle
--subprocesses --rate 100 --format raw``: idle samples included, so time blocked in a collective counts).
Every sample whose stack holds the anchor frame (the innermost one, when it recurs) is counted under the
``--depth`` frames called from it; the figures are milliseconds per step per rank (samples / rate / ranks
/ steps), so setup phases under the same anchor (model build, data) show up too, spread over the steps:
read them as what they are. Anchors: ``run (jobs/train.py`` (fsdpjob's worker), ``train_step (jobs/``
(inside its step), ``main (bare_fsdp2.py`` (the bare loop), ``_inner_training_loop`` (HF Trainer).
"""

from __future__ import annotations

import argparse
import collections
import re


def folded(path: str):
    """(frames, count) of each line of a py-spy raw (collapsed stacks) file."""
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if stack:
                yield stack.split(";"), int(count)


def short(frame: str) -> str:
    """'fn (/long/path/to/file.py:12)' -> 'fn (file.py:12)'."""
    return re.sub(r" \(.*?([^/]+:\d+)\)", r" (\1)", frame)


def breakdown(path: str, anchor: str, depth: int) -> tuple[collections.Counter, int]:
    counts: collections.Counter = collections.Counter()
    total = 0
    for frames, n in folded(path):
        at = [i for i, frame in enumerate(frames) if frame.startswith(anchor)]
        if at:
            counts[" > ".join(short(f) for f in frames[at[-1] : at[-1] + 1 + depth])] += n
            total += n
    return counts, total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("profile")
    parser.add_argument("--anchor", required=True,
                        help="the frame to fold under: its start, e.g. 'main (bare_fsdp2.py'")
    parser.add_argument("--steps", type=int, required=True, help="training steps the run made")
    parser.add_argument("--depth", type=int, default=1, help="frames below the anchor to tell apart")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--rate", type=int, default=100, help="py-spy's samples per second")
    parser.add_argument("--min-ms", type=float, default=0.3, help="leave out what costs less per step")
    args = parser.parse_args()
    counts, total = breakdown(args.profile, args.anchor, args.depth)
    per_step = 1000 / args.rate / args.ranks / args.steps
    print(f"{args.profile}: under {args.anchor!r}: {total * per_step:.1f} ms per step per rank")
    for key, n in counts.most_common():
        if n * per_step >= args.min_ms:
            print(f"{n * per_step:9.1f} ms  {key}")


if __name__ == "__main__":
    main()
