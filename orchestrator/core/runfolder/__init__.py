"""The run folder's files that cross processes (login node, batch side, workers): paths, the spec's typed copy
(runmeta), the run log and its attempts, heartbeats and the tasks' own exits, the stop hand-off, the checkpoint
sidecar and layout, the memory tier's rule, and the sweep's shared state.

A face over its modules: ``from fsdpjob.orchestrator.core.runfolder import NAME`` finds NAME in the first of
its modules that holds it, importing no module past that one (core.lazy_face). MODULES lists every module
of the package (tests/test_house.py checks it)."""

from __future__ import annotations

from .. import lazy_face

MODULES = ("paths", "runmeta", "runlog", "attempts", "heartbeat", "taskexit", "stophandoff", "sidecar", "ckptlayout",
           "memtier", "sweepstate")

__getattr__, __dir__ = lazy_face(__name__, MODULES)
