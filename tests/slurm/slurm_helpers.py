"""Plain helpers of the tests on the real Slurm dev cluster: submitting 2x2 jobs and waiting on them (the
fixtures are in conftest.py). Not named helpers.py: tests/slurm is on sys.path first and would shadow
tests/helpers.py."""

from __future__ import annotations

import json
import os
from pathlib import Path

from distributed import committed_model_state
from helpers import fsdpjob, status_json, wait_for

from fsdpjob.orchestrator.devcluster import manage
from fsdpjob.orchestrator.devcluster.manage import ClusterInfo


def slurm_env(info: ClusterInfo) -> dict[str, str]:
    """os.environ with SLURM_CONF pointing at `info`, for subprocesses of session-scoped fixtures."""
    return {**os.environ, "SLURM_CONF": str(info.slurm_conf)}


def release_held(job_id: int | str) -> None:
    """Lift the BeginTime hold of a requeued job (tests only; see manage.lift_requeue_hold)."""
    manage.lift_requeue_hold(job_id)


def status(ref: str) -> dict:
    return status_json(ref)


def submit(spec: Path, *extra: str) -> dict:
    return _json_prefix(fsdpjob("submit", str(spec), "--json", *extra, check=True).stdout)


def _json_prefix(text: str) -> dict:
    return json.loads(text[text.index("{"): text.index("}") + 1])


def final_weights(run_dir: str) -> dict:
    return committed_model_state(run_dir)


def wait_phase(ref: str, phases: set[str], timeout: float, seen: list | None = None) -> dict:
    last: dict = {}

    def probe():
        report = status(ref)
        last.update(report)
        if seen is not None and (not seen or seen[-1] != report["phase"]):
            seen.append(report["phase"])
        return report if report["phase"] in phases else None

    try:
        return wait_for(probe, timeout_s=timeout, interval_s=1.0, what=f"{ref} in {phases}")
    except AssertionError as exc:  # say where the run was instead of "last value: None"
        where = {k: last.get(k) for k in ("phase", "step", "restarts", "steps_lost", "last_stop", "failure_reason")}
        raise AssertionError(f"{exc}; its last status: {where}") from None


def in_its_own_container(pid: int) -> bool:
    """The process runs in another mount namespace than this one, and its root has no Slurm command and no
    munge socket (read through /proc/PID/root: what the process itself sees)."""
    root = Path(f"/proc/{pid}/root")
    other_ns = os.readlink(f"/proc/{pid}/ns/mnt") != os.readlink("/proc/self/ns/mnt")
    hidden = ["usr/bin/scontrol", "usr/bin/srun", "usr/bin/sbatch", "bin/scontrol", "run/munge"]
    if conf := os.environ.get("SLURM_CONF"):  # the dev cluster's config and munge socket are in its state dir
        hidden.append(conf.lstrip("/"))
    seen = [p for p in hidden if (root / p).exists()]
    return other_ns and not seen
