"""Concurrency: N `fsdpjob submit` at once to the local Slurm dev cluster while list, status and a registry reader
run in loops; counts Slurm jobs, registry records, records lost and every failed or unparseable answer.

The jobs are submitted held (a profile with sbatch_extra --hold), so they stay PENDING and cost no CPU; they
are cancelled at the end. Each submit is the real CLI in its own process (spec and data checks, planner, sbatch
through submitit, registry record). Meanwhile other processes run `fsdpjob list --json` and `fsdpjob status
--json` back to back, and a thread parses every registry file over and over.

    OMP_NUM_THREADS=1 python bench/concurrency.py [--submits 50]   (as root: it brings the dev cluster up if needed)

Prints submit latency p50/p95/max, Slurm jobs, records, records lost, list/status calls and failures,
registry reads and parse failures, and the time. Target: every count of failures and records lost 0.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml


@dataclass
class Storm:
    """What N concurrent submits and the loops around them saw."""

    latencies: list[float] = field(default_factory=list)
    submit_failures: list[str] = field(default_factory=list)
    job_ids: list[str] = field(default_factory=list)
    run_ids: list[str] = field(default_factory=list)
    records: int = 0
    lost: list[str] = field(default_factory=list)
    calls: dict[str, int] = field(default_factory=lambda: {"list": 0, "status": 0, "registry reads": 0})
    failures: dict[str, list[str]] = field(default_factory=lambda: {"list": [], "status": [], "registry reads": []})
    seconds: float = 0.0

    def summary(self) -> dict:
        lat = sorted(self.latencies)
        return {
            "submits": len(self.latencies) + len(self.submit_failures),
            "submit_failures": len(self.submit_failures),
            "submit_latency_s": {"p50": round(statistics.median(lat), 2) if lat else None,
                                 "p95": round(lat[max(0, int(0.95 * len(lat)) - 1)], 2) if lat else None,
                                 "max": round(lat[-1], 2) if lat else None},  # fmt: skip
            "slurm_jobs": len(set(self.job_ids)),
            "registry_records": self.records,
            "records_lost": len(self.lost),
            "calls": dict(self.calls),
            "failures": {k: len(v) for k, v in self.failures.items()},
            "seconds": round(self.seconds, 1),
        }


def fsdpjob(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fsdpjob.orchestrator.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=dict(os.environ, OMP_NUM_THREADS="1"))  # fmt: skip


def held_spec(folder: Path, assets: dict) -> Path:
    """A 1-node job on the dev cluster's profile, submitted held (it never starts)."""
    from fsdpjob.orchestrator.core.jobspec.profiles import available_profiles

    profile = yaml.safe_load(available_profiles()["test-cluster"].read_text())
    profile["sbatch_extra"] = [*profile.get("sbatch_extra", []), "--hold"]
    profile_path = folder / "held-cluster.yaml"
    profile_path.write_text(yaml.safe_dump(profile))
    spec = {"name": "storm", "profile": str(profile_path), "resources": {"time_limit": "5:00"},
            "model": {"path": assets["model_path"]}, "data": {"path": assets["data_path"], "seq_len": 64},
            "train": {"max_steps": 1}}  # fmt: skip
    path = folder / "storm.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def _json_answer(done: subprocess.CompletedProcess) -> str | None:
    """Why an answer counts as a failure (None: it is fine)."""
    if done.returncode != 0 or "Traceback" in done.stderr:
        return f"exit {done.returncode}: {done.stderr.strip()[-300:]}"
    try:
        json.loads(done.stdout)
    except ValueError as exc:
        return f"not JSON ({exc}): {done.stdout[:200]!r}"
    return None


def _loop(kind: str, argv: list[str], storm: Storm, stop: threading.Event, lock: threading.Lock) -> None:
    while not stop.is_set():
        problem = _json_answer(fsdpjob(*argv))
        with lock:
            storm.calls[kind] += 1
            if problem:
                storm.failures[kind].append(problem)


def _read_registry(registry: Path, storm: Storm, stop: threading.Event, lock: threading.Lock) -> None:
    while not stop.is_set():
        for path in registry.glob("*.json") if registry.is_dir() else []:
            try:
                json.loads(path.read_text(encoding="utf-8"))
                problem = None
            except (OSError, ValueError) as exc:
                problem = f"{path.name}: {exc}"
            with lock:
                storm.calls["registry reads"] += 1
                if problem:
                    storm.failures["registry reads"].append(problem)
        time.sleep(0.01)


def _submit_one(spec: Path, storm: Storm, lock: threading.Lock) -> None:
    started = time.monotonic()
    done = fsdpjob("submit", str(spec), "--json")
    took = time.monotonic() - started
    with lock:
        if done.returncode != 0:
            storm.submit_failures.append(f"exit {done.returncode}: {done.stderr.strip()[-500:]}")
            return
        answer = json.loads(done.stdout[done.stdout.index("{") : done.stdout.index("}") + 1])
        storm.latencies.append(took)
        storm.job_ids.append(answer["job_id"])
        storm.run_ids.append(answer["run_id"])


def storm(spec: Path, submits: int, home: Path) -> Storm:
    """Run ``submits`` submits at once with list/status loops and a registry reader around them."""
    result, lock, stop = Storm(), threading.Lock(), threading.Event()
    registry = home / "registry"
    watchers = [threading.Thread(target=_loop, args=("list", ["list", "--json"], result, stop, lock)),
                threading.Thread(target=_read_registry, args=(registry, result, stop, lock))]  # fmt: skip
    for t in watchers:
        t.start()
    started = time.monotonic()
    submitters = [threading.Thread(target=_submit_one, args=(spec, result, lock)) for _ in range(submits)]
    for t in submitters:
        t.start()
    # status (newest run) needs one run to exist; from then on it must always answer.
    while not list(registry.glob("*.json")) and any(t.is_alive() for t in submitters):
        time.sleep(0.05)
    status = threading.Thread(target=_loop, args=("status", ["status", "--json"], result, stop, lock))
    status.start()
    for t in submitters:
        t.join()
    result.seconds = time.monotonic() - started
    for kind, argv in (("list", ["list", "--json"]), ("status", ["status", "--json"])):  # once more, all submitted
        problem = _json_answer(fsdpjob(*argv))
        result.calls[kind] += 1
        result.failures[kind] += [problem] if problem else []
    stop.set()
    for t in [*watchers, status]:
        t.join()
    records = {json.loads(p.read_text())["run_id"] for p in registry.glob("*.json")}
    result.records = len(records)
    result.lost = sorted(set(result.run_ids) - records)
    return result


def squeue_ids() -> set[str]:
    out = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True, timeout=60).stdout
    return set(out.split())


def cancel_all(job_ids: list[str], timeout: float = 120) -> None:
    """scancel the storm's jobs and wait until the queue has none of them (other tests share the cluster)."""
    for i in range(0, len(job_ids), 100):
        subprocess.run(["scancel", *job_ids[i : i + 100]], capture_output=True, timeout=60)
    deadline = time.monotonic() + timeout
    while squeue_ids() & set(job_ids):
        if time.monotonic() > deadline:
            raise RuntimeError(f"jobs still queued after scancel: {sorted(squeue_ids() & set(job_ids))}")
        time.sleep(0.5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--submits", type=int, default=50)
    args = parser.parse_args()
    from fsdpjob.jobs.quickstart import make_quickstart
    from fsdpjob.orchestrator.devcluster import manage

    cluster = manage.up(accounting=True)  # a no-op when the dev cluster is already up
    os.environ["SLURM_CONF"] = str(cluster.slurm_conf)
    with tempfile.TemporaryDirectory(prefix="storm-") as tmp:
        os.environ["FSDPJOB_HOME"] = str(Path(tmp) / "home")
        spec = held_spec(Path(tmp), make_quickstart(Path(tmp) / "assets"))
        print(f"{args.submits} concurrent submits, load average {os.getloadavg()[0]:.1f}", flush=True)
        result = storm(spec, args.submits, Path(tmp) / "home")
        try:
            print(json.dumps(result.summary(), indent=1))
            for kind, problems in [("submit", result.submit_failures), *result.failures.items()]:
                for problem in problems[:5]:
                    print(f"{kind} failure: {problem}")
        finally:
            cancel_all(result.job_ids)
    bad = result.submit_failures or result.lost or any(result.failures.values())
    sys.exit(1 if bad or len(set(result.job_ids)) != args.submits else 0)


if __name__ == "__main__":
    main()
