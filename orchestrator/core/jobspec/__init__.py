"""What a user writes and fsdpjob checks before the queue: the job spec and its sections, cluster profiles, container
and notification settings, YAML reading with line numbers, the data formats, record and model-family rules, and the
login-node input checks.

A face over its modules: ``from fsdpjob.orchestrator.core.jobspec import NAME`` finds NAME in the module that defines
it, importing only that module (the CLI's cold start pays for no pydantic model a command does not use)."""

from __future__ import annotations

import importlib

MODULES = ("spec", "dataspec", "loggingspec", "notifyspec", "container", "profiles", "validation", "yamlio",
           "inputs", "dataformats", "records", "families")


def __getattr__(name: str):
    for module in MODULES:
        found = importlib.import_module(f"{__name__}.{module}")
        if name in vars(found) and not name.startswith("_"):
            return vars(found)[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *MODULES})
