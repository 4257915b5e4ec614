"""A sweep's two files in its folder (above its runs' folders), typed: ``sweep.json``, what `fsdpjob sweep`
submitted (written once on the login node, read by the batch side), and ``ended.json``, how each of its tasks
ended (written by the batch side of each task, under a lock: the tasks end on different nodes at any time).
The one place that spells these files' names and keys. Standard library only, like runmeta.py.
"""

from __future__ import annotations

import fcntl
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..fileio import write_atomic

SWEEP_FILE = "sweep.json"
ENDED_FILE = "ended.json"  # run id -> how that task ended (done or failed)


@dataclass(frozen=True)
class SweepTask:
    index: int
    run_id: str
    values: dict[str, Any]


@dataclass(frozen=True)
class SweepState:
    """The sweep.json of a sweep: its id and name, the array job, and its tasks' runs."""

    id: str
    name: str
    job_id: str | None  # the array job's id
    array: str  # sbatch's --array value
    runs: tuple[SweepTask, ...]

    @property
    def run_ids(self) -> set[str]:
        return {r.run_id for r in self.runs}

    def write(self, sweep_dir: Path) -> None:
        write_atomic(sweep_dir / SWEEP_FILE, json.dumps({**asdict(self), "runs": [asdict(r) for r in self.runs]},
                                                        indent=1))

    @classmethod
    def read(cls, sweep_dir: Path) -> SweepState:
        """Raises OSError (no such file: a run of no sweep) or ValueError (not a sweep.json)."""
        data = json.loads((sweep_dir / SWEEP_FILE).read_text(encoding="utf-8"))
        try:
            runs = tuple(SweepTask(index=int(r["index"]), run_id=_text(r["run_id"]), values=dict(r.get("values") or {}))
                         for r in data["runs"])
            return cls(id=_text(data["id"]), name=str(data.get("name") or ""), job_id=data.get("job_id"),
                       array=str(data.get("array") or ""), runs=runs)
        except (KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"{sweep_dir / SWEEP_FILE} is not a sweep's file: {exc!r}") from None


def _text(value: object) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{value!r} is not a string")
    return value


def record_end(sweep_dir: Path, run_id: str, outcome: str) -> tuple[dict[str, str], dict[str, str]]:
    """Record in ended.json that ``run_id`` ended with ``outcome``; (ended before, ended now), read and written
    under one exclusive lock, so that of two tasks ending together exactly one sees the sweep complete."""
    with open(sweep_dir / (ENDED_FILE + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        path = sweep_dir / ENDED_FILE
        before = json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}
        now = {**before, run_id: outcome}
        write_atomic(path, json.dumps(now))
    return before, now
