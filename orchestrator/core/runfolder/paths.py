"""Where things live: the fsdpjob home, run folders and the files inside them (pure; shared with jobs/)."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

from .. import envvars


def fsdpjob_home() -> Path:
    """$FSDPJOB_HOME, default ~/.fsdpjob: the registry and, unless --runs-dir says otherwise, the runs."""
    return Path(envvars.get("FSDPJOB_HOME") or Path.home() / ".fsdpjob").expanduser()


def runs_root() -> Path:
    return Path(envvars.get("FSDPJOB_RUNS") or fsdpjob_home() / "runs").expanduser()


def new_run_id(name: str, now: float | None = None) -> str:
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime(now if now is not None else time.time()))
    return f"{name}-{stamp}-{os.urandom(2).hex()}"


@dataclass(frozen=True)
class RunPaths:
    """The layout of one run folder; the worker and the CLI both use it."""

    run_dir: Path

    @property
    def run_id(self) -> str:
        return self.run_dir.name

    @property
    def spec_file(self) -> Path:
        """The resolved, redacted spec (JSON) the workers read."""
        return self.run_dir / "spec.json"

    @property
    def sbatch_file(self) -> Path:
        return self.run_dir / "job.sbatch"

    @property
    def submitit_dir(self) -> Path:
        return self.run_dir / "submitit"

    @property
    def logs_dir(self) -> Path:
        return self.submitit_dir

    def rank_log(self, job_id: str, rank: int, stream: str = "out") -> Path:
        return self.submitit_dir / f"{job_id}_{rank}_log.{stream}"

    @property
    def metrics_file(self) -> Path:
        return self.run_dir / "metrics.jsonl"

    @property
    def stop_file(self) -> Path:
        """The workers' stop hand-off to the supervisor (core/runfolder/stophandoff.py), present between the two."""
        return self.run_dir / "stop.json"

    @property
    def events_file(self) -> Path:
        """One JSON line per lifecycle event (start, resume, checkpoint, stop, requeue, done, failed)."""
        return self.run_dir / "events.jsonl"

    @property
    def checkpoints_dir(self) -> Path:
        return self.run_dir / "checkpoints"

    @property
    def cache_dir(self) -> Path:
        """The tokenized, packed data set, reused by every later start of the run (jobs/data/cache.py)."""
        return self.run_dir / "cache"

    @property
    def export_dir(self) -> Path:
        return self.run_dir / "export"

    @property
    def tensorboard_dir(self) -> Path:
        return self.run_dir / "tensorboard"


def is_within(path: Path, folder: Path) -> bool:
    """Whether ``path`` is ``folder`` or lies under it (both taken as they are: resolve them first)."""
    return path == folder or folder in path.parents
