"""Run lineage for `status`: the checkpoint a run started from (submit --resume-from) and the run that wrote it."""

from __future__ import annotations

from pathlib import Path

from fsdpjob.orchestrator import registry
from fsdpjob.orchestrator.core.runfolder.paths import is_within
from fsdpjob.orchestrator.core.runfolder.runmeta import RunMeta
from fsdpjob.orchestrator.registry import JobRecord


def resumed_from(record: JobRecord) -> dict | None:
    """{"path": the --resume-from, "run_id": the registry run whose folder holds it, or None}; None for a run
    that started fresh (or whose spec.json cannot be read)."""
    try:
        source = RunMeta.read(record.run_dir).resume_from
    except (OSError, ValueError, TypeError):
        return None
    if not source:
        return None
    path = Path(source).resolve()
    parents = [r.run_id for r in registry.all_records()
               if r.run_id != record.run_id and is_within(path, Path(r.run_dir).resolve())]
    return {"path": source, "run_id": parents[-1] if parents else None}
