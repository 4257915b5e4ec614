"""What a user writes and fsdpjob checks before the queue: the job spec and its sections, cluster profiles, container
and notification settings, YAML reading with line numbers, the data formats, record and model-family rules, and the
login-node input checks.

A face over its modules: ``from fsdpjob.orchestrator.core.jobspec import NAME`` finds NAME in the first of
its modules that holds it, importing no module past that one (core.lazy_face)."""

from __future__ import annotations

from .. import lazy_face

MODULES = ("spec", "dataspec", "loggingspec", "notifyspec", "container", "profiles", "validation", "yamlio",
           "inputs", "dataformats", "records", "families", "unionwords")

__getattr__, __dir__ = lazy_face(__name__, MODULES)
