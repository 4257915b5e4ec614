"""Steps lost per signalled preemption (target 0) and time from the signal to the committed checkpoint.

    SLURM_CONF=/tmp/fsdpjob-devcluster/etc/slurm.conf python bench/preemption.py [--preemptions 3]

Needs the dev cluster (`fsdpjob dev-cluster up`). Submits one 2-node x 2-task FSDP2 run of the tiny
quickstart model, preempts it N times with a high-tier job, lifts each requeue's 120 s BeginTime hold (a
benchmark shortcut the product never takes), and reads the worker's own events: the stop step, the step
the next attempt resumed from, the signal->commit time measured inside the workers, and the time from
submitting the preemptor to the commit.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml
from devjobs import cli, poll, status  # bench/devjobs.py (this folder is on sys.path)

from fsdpjob.orchestrator.devcluster.manage import lift_requeue_hold


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preemptions", type=int, default=3)
    args = parser.parse_args()
    if not os.environ.get("SLURM_CONF"):
        sys.exit("needs the dev cluster: fsdpjob dev-cluster up, then export SLURM_CONF=...")
    from fsdpjob.jobs.quickstart import make_quickstart

    with tempfile.TemporaryDirectory(prefix="fsdpjob-preempt-bench-") as tmp:
        root = Path(tmp)
        os.environ["FSDPJOB_HOME"] = str(root / "home")
        assets = make_quickstart(root / "assets")
        spec = {
            "name": "preempt-bench", "profile": "test-cluster",
            "resources": {"nodes": 2, "time_limit": "30:00"},
            "model": {"path": assets["model_path"]},
            "data": {"path": assets["data_path"], "seq_len": 64},
            "train": {"max_steps": 60 + 40 * args.preemptions, "micro_batch_size": 2, "lr": 3e-3, "log_every": 1},
            "fsdp": {"mixed_precision": "fp32"},
            "checkpoint": {"interval_steps": 0, "interval_minutes": 0},
        }
        (root / "spec.yaml").write_text(yaml.safe_dump(spec))
        out = cli("submit", str(root / "spec.yaml"), "--json")
        run = json.loads(out[out.index("{"): out.index("}") + 1])
        run_dir, job_id = Path(run["run_dir"]), run["job_id"]
        preempted_at: list[float] = []
        for i in range(args.preemptions):
            base = status(run["run_id"])["step"] or 0
            poll(lambda: (status(run["run_id"])["phase"] == "RUNNING"
                          and (status(run["run_id"])["step"] or 0) >= base + 10),  # noqa: B023 - polled here
                 300, f"10 more steps before preemption {i + 1}")
            preempted_at.append(time.time())
            subprocess.run(["sbatch", "--output=/dev/null", "-p", "high", "-N2", "--exclusive", "--wrap", "sleep 2"],
                           check=True, capture_output=True)
            poll(lambda: subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True,
                                        text=True).stdout.strip() == "PENDING", 120, "the requeue")
            lift_requeue_hold(job_id)  # bench only: skip Slurm's 120 s BeginTime hold

        def finished():
            state = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True)
            if state.stdout.strip() == "PENDING":
                lift_requeue_hold(job_id)
            report = status(run["run_id"])
            return report if report["phase"] in ("COMPLETED", "FAILED") else None

        final = poll(finished, 600, "the run to finish")
        events = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]
    stops = [e for e in events if e["event"] == "stop"]
    resumes = [e for e in events if e["event"] == "resume"]
    print(f"run {final['phase']} at step {final['step']}, restarts {final['restarts']}, "
          f"steps lost (status) {final['steps_lost']}")
    print(f"{'#':>2} {'stop step':>9} {'resumed at':>10} {'steps lost':>10} {'signal->commit s':>16} "
          f"{'preemptor->commit s':>19}")
    for i, (stop, resume) in enumerate(zip(stops, resumes)):
        lost = stop["step"] - resume["step"]
        print(f"{i + 1:>2} {stop['step']:>9} {resume['step']:>10} {lost:>10} {stop['signal_to_commit_s']:>16.2f} "
              f"{stop['time'] - preempted_at[i]:>19.2f}")
    print(f"median signal->commit {statistics.median(s['signal_to_commit_s'] for s in stops):.2f} s; "
          "steps lost per preemption "
          f"{sum(s['step'] - r['step'] for s, r in zip(stops, resumes)) / max(1, len(stops)):.1f} (target 0)")


if __name__ == "__main__":
    main()
