"""The run folder's files that cross processes (login node, batch side, workers): paths, the spec's typed copy
(runmeta), the run log and its attempts, heartbeats, the stop hand-off, the checkpoint sidecar and layout, the
memory tier's rule, and the sweep's shared state.

A face over its modules: ``from fsdpjob.orchestrator.core.runfolder import NAME`` finds NAME in the module that defines
it, importing only that module (the CLI's cold start pays for no pydantic model a command does not use)."""

from __future__ import annotations

import importlib

MODULES = ("paths", "runmeta", "runlog", "attempts", "heartbeat", "stophandoff", "sidecar", "ckptlayout",
           "memtier", "sweepstate", "goodputaccount")


def __getattr__(name: str):
    for module in MODULES:
        found = importlib.import_module(f"{__name__}.{module}")
        if name in vars(found) and not name.startswith("_"):
            return vars(found)[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *MODULES})
