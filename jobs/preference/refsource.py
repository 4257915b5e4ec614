"""Where a run's reference comes from when it resumes past step 0 without a cache of its own (``submit
--resume-from`` a step folder of another run, or its own folder's cache lost): the reference of a run is the model
it started from, which by then is trained. The cache the checkpoint's run wrote is the same reference (its folder
key holds the table, model.path, dtype and precision, and resume refuses another model.path); without one, the pass
runs again on a fresh copy of the starting weights (jobs/preference/setup.py). Never the trained weights."""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

from fsdpjob.orchestrator.core.fileio import write_atomic
from fsdpjob.orchestrator.core.runfolder.paths import RunPaths

from .reference import FOLDER, ReferenceCache

log = logging.getLogger("fsdpjob.reference")


def source_run_dir(resume_from: str | None) -> Path | None:
    """The run folder that holds ``resume_from`` (a step folder, its checkpoints folder or the run folder): the
    nearest folder at or above it with a spec.json; None when there is none (a checkpoint.dir outside any run)."""
    if not resume_from:
        return None
    path = Path(resume_from).resolve()
    return next((folder for folder in (path, path.parent, path.parent.parent)
                 if RunPaths(folder).spec_file.is_file()), None)


def cache_of_source(own: ReferenceCache, run_dir: Path, resume_from: str | None) -> ReferenceCache | None:
    """The complete cache under the same key in the run that wrote the checkpoint this run resumed from; None
    where that run is this one, is not found, or has no complete cache for this table and model."""
    source = source_run_dir(resume_from)
    if source is None or source.resolve() == Path(run_dir).resolve():
        return None
    cache = ReferenceCache(source / FOLDER / own.folder.name, own.rows, own.width)
    return cache if cache.complete else None


def adopt(own: ReferenceCache, source: ReferenceCache, is_main: bool) -> None:
    """Every rank reads ``source``; rank 0 copies its chunks into this run's folder (each file whole: copy, then
    rename; complete.json last), so that this run's own restarts read its own cache whatever becomes of the other
    run's folder."""
    source.load_written()
    own.logps = source.logps
    if not is_main:
        return
    own.folder.mkdir(parents=True, exist_ok=True)
    for path in sorted(source.folder.glob("chunk-*.pt")):
        tmp = own.folder / f".{path.name}.{os.getpid()}.tmp"
        shutil.copyfile(path, tmp)
        os.replace(tmp, own.folder / path.name)
    done = json.loads((source.folder / "complete.json").read_text())
    write_atomic(own.folder / "complete.json", json.dumps({**done, "copied_from": str(source.folder)}))
    log.info("reference cache copied from %s (the run this one resumed from)", source.folder)
