"""The core both sides share (login node and workers): spec and profile models, YAML reading, run-folder
paths, the run log, the checkpoint layout, atomic file writes, errors, units and Slurm time.

Imports no other part of fsdpjob and never torch (checked by lint-imports, see pyproject.toml)."""

from __future__ import annotations

import importlib


def lazy_face(package: str, modules: tuple[str, ...]):
    """A sub-package's ``__getattr__`` and ``__dir__``: ``from PACKAGE import NAME`` imports ``modules`` in order until
    one of them holds a public NAME, so a command pays only for the modules it reaches (the CLI's cold start builds
    no pydantic model it does not use)."""

    def getattr_(name: str):
        if name in modules:  # `from PACKAGE import MODULE` asks here first: that module alone, not those before it
            return importlib.import_module(f"{package}.{name}")
        for module in modules:
            found = vars(importlib.import_module(f"{package}.{module}"))
            if name in found and not name.startswith("_"):
                return found[name]
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def dir_() -> list[str]:
        return sorted({*vars(importlib.import_module(package)), *modules})

    return getattr_, dir_

