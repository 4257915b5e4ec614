"""What a user writes and fsdpjob reads before the queue: the job spec and its sections (the method sections among
them), cluster profiles, container and notification settings, YAML reading with line numbers, the spec's error
wording, and the model-family table. The checks of the inputs the spec names are core/inputs/'s.

A face over its modules: ``from fsdpjob.orchestrator.core.jobspec import NAME`` finds NAME in the first of
its modules that holds it, importing no module past that one (core.lazy_face). MODULES lists every module
of the package (tests/test_house.py checks it)."""

from __future__ import annotations

from .. import lazy_face

MODULES = ("spec", "dataspec", "loggingspec", "notifyspec", "container", "profiles", "validation", "yamlio", "families",
           "unionwords", "methods", "modelspec", "resources", "fielddocs")

__getattr__, __dir__ = lazy_face(__name__, MODULES)
