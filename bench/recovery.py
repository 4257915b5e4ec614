"""Recovery inside the allocation (issue 12), default settings, on the dev cluster's 2 nodes x 2 tasks:

    SLURM_CONF=/tmp/fsdpjob-devcluster/etc/slurm.conf python bench/recovery.py [--rounds 1]

Needs the dev cluster (`fsdpjob dev-cluster up`). One quickstart-model run per case, faults injected by the
bench, times read from the run log (the supervisor's ``fault`` event and the workers' metrics, one per step):
- hang (SIGSTOP of one rank): onset -> detected; detected -> first trained step after the restart;
- crash (SIGKILL of one rank): kill -> first trained step after the restart;
- the same crash through the requeue path (recovery.max_restarts: 0, which is where every crash went before
  the supervisor): kill -> first trained step, Slurm's BeginTime hold included (the bench does not lift it).
Targets with defaults: hang detected within 60 s of its onset; crash or detected hang -> first trained step
within 30 s; the requeue path as the comparison (>= 120 s).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml
from devjobs import cli, poll, recovery_spec, status  # bench/devjobs.py (this folder is on sys.path)


def run_case(root: Path, assets: dict, case: str) -> dict:
    spec = recovery_spec(f"recovery-{case}", assets)
    if case == "requeue":
        spec["recovery"] = {"max_restarts": 0}
    path = root / f"{case}.yaml"
    path.write_text(yaml.safe_dump(spec))
    out = cli("submit", str(path), "--json")
    run = json.loads(out[out.index("{"): out.index("}") + 1])
    run_dir = Path(run["run_dir"])
    poll(lambda: (status(run["run_id"])["step"] or 0) >= 30, 300, f"{case}: step 30")
    beat = json.loads((run_dir / "heartbeat" / "rank-3.json").read_text())
    at = time.time()
    os.kill(beat["pid"], signal.SIGSTOP if case == "hang" else signal.SIGKILL)
    # The first step trained after the fault: a metric line of a later start than the faulted one.
    def first_step_after():
        metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
        events = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]
        ready = [e for e in events if e["event"] == "ready" and e["time"] > at]
        after = [m for m in metrics if ready and m["time"] > ready[0]["time"] and "loss" in m]
        return (after[0], events) if after else None
    first, events = poll(first_step_after, 600, f"{case}: training after the fault")
    subprocess.run(["scancel", run["job_id"]], capture_output=True)
    poll(lambda: not subprocess.run(["squeue", "-h", "-j", run["job_id"]],
                                    capture_output=True, text=True).stdout.strip(),
         120, f"{case}: the cancelled job to leave the queue")
    fault = next((e for e in events if e["event"] == "fault" and e["time"] > at), None)
    row = {"case": case, "fault_to_first_step_s": first["time"] - at}
    if fault is not None:
        row["detected_s"] = fault["detected_at"] - at
        row["detected_to_first_step_s"] = first["time"] - fault["detected_at"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--cases", default="hang,crash,requeue")
    args = parser.parse_args()
    if not os.environ.get("SLURM_CONF"):
        sys.exit("needs the dev cluster: fsdpjob dev-cluster up, then export SLURM_CONF=...")
    from fsdpjob.jobs.quickstart import make_quickstart

    rows = []
    # The cancelled runs' workers may still write while the folder goes: leave what cannot be removed.
    with tempfile.TemporaryDirectory(prefix="fsdpjob-recovery-bench-", ignore_cleanup_errors=True) as tmp:
        root = Path(tmp)
        os.environ["FSDPJOB_HOME"] = str(root / "home")
        assets = make_quickstart(root / "assets")
        for _ in range(args.rounds):
            for case in args.cases.split(","):
                rows.append(run_case(root, assets, case))
                print(json.dumps(rows[-1]), flush=True)
    print(f"{'case':<8} {'onset->detected s':>17} {'detected->step s':>16} {'fault->first step s':>19}")
    for case in args.cases.split(","):
        mine = [r for r in rows if r["case"] == case]
        med = lambda k: statistics.median(r[k] for r in mine) if all(k in r for r in mine) else float("nan")  # noqa: E731, B023 - used in this iteration
        print(f"{case:<8} {med('detected_s'):>17.1f} {med('detected_to_first_step_s'):>16.1f} "
              f"{med('fault_to_first_step_s'):>19.1f}")


if __name__ == "__main__":
    main()
