"""The job registry: one JSON record per run under $FSDPJOB_HOME/registry, atomic writes under a lock."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

from fsdpjob.orchestrator.core.errors import AmbiguousRun, RunNotFound
from fsdpjob.orchestrator.core.fileio import write_atomic
from fsdpjob.orchestrator.core.runfolder.paths import fsdpjob_home


@dataclass
class JobRecord:
    run_id: str
    name: str
    run_dir: str
    scheduler: str  # "slurm" | "local"
    job_id: str
    profile: str
    submitted_at: float
    spec_hash: str
    nodes: int
    tasks_per_node: int
    max_steps: int
    slurm_conf: str | None = None
    extra: dict = field(default_factory=dict)
    gpus_per_node: int | None = None  # 0 on CPU profiles; None in records written before it was kept
    # A task of a sweep (orchestrator/cli/sweeps/submit.py): {id, name, index, count, values, job_id (the array job's)}.
    sweep: dict | None = None

    @property
    def world_size(self) -> int:
        return self.nodes * self.tasks_per_node


def registry_dir() -> Path:
    return fsdpjob_home() / "registry"


def _private_dir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    path.chmod(0o700)  # also when it existed: records name every run and its folder
    return path


@contextmanager
def _locked() -> Iterator[Path]:
    """The registry folder, held under its lock: concurrent submits never lose a record."""
    from filelock import FileLock  # imported here: 0.1 s that list/status don't need

    root = _private_dir(registry_dir())
    with FileLock(str(root / ".lock"), timeout=30, mode=0o600):
        yield root


def save(record: JobRecord) -> None:
    """Add or replace a record (one file per run)."""
    with _locked() as root:
        write_atomic(root / f"{record.run_id}.json", json.dumps(asdict(record), indent=1, sort_keys=True))


def forget(record: JobRecord) -> None:
    """Remove a run's record (`fsdpjob prune`, after its folder)."""
    with _locked() as root:
        (root / f"{record.run_id}.json").unlink(missing_ok=True)


def _read(path: Path) -> JobRecord | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        known = {k: v for k, v in data.items() if k in JobRecord.__dataclass_fields__}
        return JobRecord(**known)
    except (OSError, ValueError, TypeError):
        return None  # a record that cannot be read is skipped, never fatal for list/status


def all_records() -> list[JobRecord]:
    root = registry_dir()
    if not root.is_dir():
        return []
    records = [r for p in root.glob("*.json") if (r := _read(p)) is not None]
    return sorted(records, key=lambda r: r.submitted_at)


def find(ref: str) -> JobRecord:
    """A run by run id, Slurm job id, run name (newest wins: a name is meant to repeat) or unique run id prefix.

    An id or prefix that fits several runs is refused with their ids: picking one would act on a run the user
    did not mean (status, report, logs, cancel, export all come through here)."""
    records = all_records()
    for what, match in (
        ("run id", [r for r in records if r.run_id == ref]),
        ("job id", [r for r in records if r.job_id == ref]),
        ("name", [r for r in records if r.name == ref]),
        ("run id prefix", [r for r in records if r.run_id.startswith(ref)]),
    ):
        if len(match) > 1 and what != "name":
            raise AmbiguousRun(ref, what, [r.run_id for r in reversed(match)])
        if match:
            return match[-1]
    raise RunNotFound(f"no run {ref!r} in the registry ({registry_dir()}); see `fsdpjob list`")


def sweep_records(ref: str) -> list[JobRecord]:
    """The runs of a sweep, by index: ``ref`` is its id, its name (newest sweep of that name) or its array job's
    id; [] when no sweep fits (the caller then looks for a run)."""
    tasks = [r for r in all_records() if r.sweep]
    for key in ("id", "job_id", "name"):
        match = [r for r in tasks if r.sweep.get(key) == ref]
        if match:
            newest = match[-1].sweep["id"]
            return sorted((r for r in match if r.sweep["id"] == newest), key=lambda r: r.sweep["index"])
    return []


def latest() -> JobRecord:
    records = all_records()
    if not records:
        raise RunNotFound("no runs yet; submit one with `fsdpjob submit SPEC`")
    return records[-1]
