"""One worker case of bench/gpu.py: fsdpjob's worker in this process, then what only this process can tell.

    python bench/gpu_worker.py RUN_DIR OUT.json [--backend aot_eager]

Runs ``fsdpjob.jobs.train.run(RUN_DIR)`` (the torchrun-style environment comes from the caller) and writes OUT.json,
even when the worker raised: the process's peak resident memory (VmHWM, the host side the planner's host peak
predicts) and torch._dynamo's counters (frames, graphs, graph breaks, recompiles and recompile-limit hits: with
``model.compile`` a per-block guard that fails would recompile each block until dynamo's limit, then run eager).
``--backend`` swaps inductor for another dynamo backend (``--tiny`` on CPU: inductor's C++ builds take minutes).
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

from bare_fsdp2 import vmhwm_mb  # bench/ is this script's folder: on sys.path


class _Count(logging.Handler):
    """Counts the records whose message starts with one of ``prefixes``."""

    def __init__(self, prefixes: tuple[str, ...]):
        super().__init__(logging.DEBUG)
        self.prefixes, self.counts = prefixes, dict.fromkeys(prefixes, 0)

    def emit(self, record: logging.LogRecord) -> None:
        message = str(record.msg)
        for prefix in self.prefixes:
            if message.startswith(prefix):
                self.counts[prefix] += 1


def watch_dynamo() -> _Count:
    """Count recompiles (dynamo's 'recompiles' log artifact) and recompile-limit hits (its warning)."""
    import torch
    import torch._dynamo

    torch._logging.set_logs(recompiles=True)  # the artifact is off unless asked for; it also prints the reasons
    handler = _Count(("Recompiling function", "torch._dynamo hit config."))
    # The artifact's logger does not propagate, and its module moved between releases: every logger of it.
    names = [n for n in logging.Logger.manager.loggerDict if n.endswith("__recompiles")] + ["torch._dynamo"]
    for name in names:
        logging.getLogger(name).addHandler(handler)
    return handler


def dynamo_figures(handler: _Count) -> dict:
    from torch._dynamo.utils import counters

    return {"frames": counters["frames"].get("total", 0), "frames_ok": counters["frames"].get("ok", 0),
            "graphs": counters["stats"].get("unique_graphs", 0), "graph_breaks": sum(counters["graph_break"].values()),
            "recompiles": handler.counts["Recompiling function"],
            "recompile_limit_hits": handler.counts["torch._dynamo hit config."],
            "break_reasons": [reason.splitlines()[0][:200] for reason in counters["graph_break"]][:10]}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir")
    parser.add_argument("out", type=Path)
    parser.add_argument("--backend", help="dynamo backend instead of inductor for model.compile")
    args = parser.parse_args()
    import torch

    if args.backend:
        compile_ = torch.compile

        def compile_with(fn=None, *rest, backend=None, **kw):
            return compile_(fn, *rest, backend=args.backend, **kw)

        torch.compile = compile_with
    handler = watch_dynamo()
    from fsdpjob.jobs.train import run

    try:
        run(args.run_dir)
    finally:
        args.out.write_text(json.dumps({"vmhwm_mb": vmhwm_mb(), "dynamo": dynamo_figures(handler)}) + "\n")


if __name__ == "__main__":
    main()
