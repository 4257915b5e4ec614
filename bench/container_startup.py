"""What a container adds to a job's start (issue 23): the same quickstart-size 2 nodes x 2 tasks run on the
host and in the dev cluster's test image (bubblewrap in each task), alternating, on the dev cluster:

    fsdpjob dev-cluster up --containers   # prints SLURM_CONF and FSDPJOB_TEST_IMAGE
    SLURM_CONF=... FSDPJOB_TEST_IMAGE=... python bench/container_startup.py [--pairs 3]

Per run: seconds from the allocation's start (sacct Start) to the workers' `start` event (the batch script,
the supervisor, srun, the container and Python's imports), to `ready` (model, data cache, process group) and to
the first trained step. The data cache is written once before the pairs, so every run reads it. Prints the
medians and container / host ratios.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml
from devjobs import cli, poll, status  # bench/devjobs.py (this folder is on sys.path)


def timings(run: dict) -> dict:
    run_dir = Path(run["run_dir"])
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    sacct = subprocess.run(["sacct", "-X", "-n", "-P", "-j", run["job_id"], "-o", "Start"], capture_output=True,
                           text=True, check=True).stdout.split()[0]
    t0 = datetime.datetime.fromisoformat(sacct).timestamp()
    start = next(e["time"] for e in events if e["event"] == "start")
    ready = next(e["time"] for e in events if e["event"] == "ready")
    first = next(m["time"] for m in metrics if "loss" in m)
    return {"to_start_s": round(start - t0, 1), "to_ready_s": round(ready - t0, 1),
            "to_first_step_s": round(first - t0, 1)}


def one(spec: Path, *extra: str) -> dict:
    out = cli("submit", str(spec), "--json", *extra)
    run = json.loads(out[out.index("{"): out.index("}") + 1])
    poll(lambda: status(run["run_id"])["phase"] in ("COMPLETED", "FAILED"), 600, f"run {run['run_id']}")
    assert status(run["run_id"])["phase"] == "COMPLETED", run
    return timings(run)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=3)
    args = parser.parse_args()
    image = os.environ.get("FSDPJOB_TEST_IMAGE")
    if not os.environ.get("SLURM_CONF") or not image:
        sys.exit("needs the dev cluster with containers: fsdpjob dev-cluster up --containers, then both exports")
    from fsdpjob.jobs.quickstart import make_quickstart

    container = ("--set", "profile=test-cluster-container", "--set", f"container.image={image}")
    rows: dict[str, list[dict]] = {"host": [], "container": []}
    with tempfile.TemporaryDirectory(prefix="fsdpjob-cstart-", ignore_cleanup_errors=True) as tmp:
        root = Path(tmp)
        os.environ["FSDPJOB_HOME"] = str(root / "home")
        assets = make_quickstart(root / "assets")
        spec = root / "start.yaml"
        spec.write_text(yaml.safe_dump({
            "name": "cstart", "profile": "test-cluster", "resources": {"nodes": 2, "time_limit": "30:00"},
            "model": {"path": assets["model_path"]}, "data": {"path": assets["data_path"], "seq_len": 64},
            "train": {"max_steps": 3, "micro_batch_size": 2, "log_every": 1}, "fsdp": {"mixed_precision": "fp32"},
            "checkpoint": {"interval_steps": 0, "interval_minutes": 0},
        }))
        one(spec)  # writes the data cache that every measured run then reads
        for n in range(args.pairs):
            for kind, extra in (("host", ()), ("container", container)) if n % 2 == 0 else \
                    (("container", container), ("host", ())):
                rows[kind].append(one(spec, *extra))
                print(json.dumps({"pair": n, "kind": kind, **rows[kind][-1]}), flush=True)
    for key in ("to_start_s", "to_ready_s", "to_first_step_s"):
        host = statistics.median(r[key] for r in rows["host"])
        cont = statistics.median(r[key] for r in rows["container"])
        print(f"{key}: host {host:.1f} s, container {cont:.1f} s, container - host {cont - host:+.1f} s "
              f"(ratio {cont / host:.2f}), medians of {args.pairs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
