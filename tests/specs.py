"""The tests' one job-spec builder: a dict in (a base, sections merged over it), a YAML file or a JobSpec out."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml


def build(base: dict[str, Any], /, **changes: Any) -> dict[str, Any]:
    """A copy of ``base`` with ``changes``: ``section={...}`` merges into that section, ``section__field=v``
    sets one (nested) field, anything else replaces the top-level key."""
    spec = copy.deepcopy(base)
    for key, value in changes.items():
        if "__" in key:
            *parents, leaf = key.split("__")
            node = spec
            for part in parents:
                node = node.setdefault(part, {})
            node[leaf] = value
        elif isinstance(value, dict) and isinstance(spec.get(key), dict):
            spec[key] = {**spec[key], **value}
        else:
            spec[key] = value
    return spec


def write_spec(path: Path, spec: dict[str, Any]) -> Path:
    """``spec`` as a YAML file at ``path`` (what `fsdpjob validate/submit` read)."""
    path.write_text(yaml.safe_dump(spec), encoding="utf-8")
    return path


def job_spec(spec: dict[str, Any]):
    """``spec`` validated, as the worker and the planner take it."""
    from fsdpjob.orchestrator.core.spec import JobSpec

    return JobSpec.model_validate(spec)
