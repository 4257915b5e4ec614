"""`fsdpjob status` and `fsdpjob list` wall time with 200 runs in the registry, and how many scheduler calls they make.

    SLURM_CONF=/tmp/fsdpjob-devcluster/etc/slurm.conf python bench/status_latency.py

Needs a running Slurm (e.g. `fsdpjob dev-cluster up`). The 200 records point at run folders with real
metrics/events files and at Slurm job ids known to the cluster (reused round-robin), so sacct answers for
real. Every Slurm client call goes through a counting shim on PATH. Target: <= 0.5 s and one scheduler call
for `list`.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

N_RUNS = 200
REPEATS = 7


def shim_dir(root: Path) -> Path:
    """sacct/squeue/scontrol wrappers that log each call, then run the real command."""
    bin_dir = root / "bin"
    bin_dir.mkdir()
    for name in ("sacct", "squeue", "scontrol", "sbatch", "scancel"):
        real = shutil.which(name)
        if real:
            (bin_dir / name).write_text(f'#!/bin/sh\necho {name} >> "$SHIM_LOG"\nexec {real} "$@"\n')
            (bin_dir / name).chmod(0o755)
    return bin_dir


def populate(home: Path, job_ids: list[str]) -> None:
    from fsdpjob.orchestrator import registry
    from fsdpjob.orchestrator.registry import JobRecord

    os.environ["FSDPJOB_HOME"] = str(home)
    now = time.time()
    for i in range(N_RUNS):
        run_dir = home / "runs" / f"bench-{i:03d}"
        (run_dir / "checkpoints" / "step-00000100").mkdir(parents=True)
        (run_dir / "checkpoints" / "step-00000100" / "COMMITTED").write_text("{}")
        metrics = [{"step": s, "loss": 2.0 - s / 1000, "tokens_per_s": 1000.0, "eta_s": 10.0, "time": now + s}
                   for s in range(1, 201)]
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
        events = [{"event": "start", "restart": 0, "time": now}, {"event": "ready", "step": 0, "time": now + 1}]
        (run_dir / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
        registry.save(JobRecord(run_id=f"bench-{i:03d}", name="bench", run_dir=str(run_dir), scheduler="slurm",
                                job_id=job_ids[i % len(job_ids)], profile="test-cluster", submitted_at=now + i,
                                spec_hash="0", nodes=2, tasks_per_node=2, max_steps=1000,
                                extra={"accounting": True}))


def timed(argv: list[str], env: dict) -> tuple[float, list[str]]:
    log = Path(env["SHIM_LOG"])
    log.write_text("")
    t0 = time.perf_counter()
    proc = subprocess.run(argv, env=env, capture_output=True, text=True)
    elapsed = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed: {proc.stderr}")
    return elapsed, log.read_text().split()


def main() -> None:
    if not os.environ.get("SLURM_CONF") or not shutil.which("sacct"):
        sys.exit("needs a running Slurm: fsdpjob dev-cluster up, then export SLURM_CONF=...")
    ids = subprocess.run(["sacct", "-X", "-n", "-P", "-o", "JobIDRaw", "-S", "2000-01-01"],
                         capture_output=True, text=True, check=True).stdout.split()
    if not ids:
        sys.exit("the cluster knows no jobs yet: submit one first (any sbatch --wrap job will do)")
    with tempfile.TemporaryDirectory(prefix="fsdpjob-status-bench-") as tmp:
        root = Path(tmp)
        populate(root / "home", ids)
        env = dict(os.environ, PATH=f"{shim_dir(root)}:{os.environ['PATH']}", SHIM_LOG=str(root / "calls.log"),
                   FSDPJOB_HOME=str(root / "home"))
        fsdpjob = [sys.executable, "-m", "fsdpjob.orchestrator.cli"]
        rows = []
        for label, argv in (("python -c pass", [sys.executable, "-c", "pass"]),
                            ("fsdpjob list --json", fsdpjob + ["list", "--json"]),
                            ("fsdpjob list (table)", fsdpjob + ["list"]),
                            ("fsdpjob status RUN --json", fsdpjob + ["status", "bench-150", "--json"])):
            timed(argv, env)  # warm-up
            runs = [timed(argv, env) for _ in range(REPEATS)]
            rows.append((label, statistics.median(t for t, _ in runs), runs[-1][1]))
    print(f"{N_RUNS} runs in the registry, median of {REPEATS} (wall seconds)")
    print(f"{'command':<28} {'median s':>9}  scheduler calls")
    for label, median, calls in rows:
        print(f"{label:<28} {median:>9.3f}  {len(calls)} {' '.join(calls)}")
    worst = max(m for label, m, _ in rows if label.startswith("fsdpjob"))
    print(f"target <= 0.5 s: {'met' if worst <= 0.5 else 'missed'} (worst {worst:.3f} s)")


if __name__ == "__main__":
    main()
