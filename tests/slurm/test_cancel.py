"""A cancelled job stays cancelled: the batch script's failure policy (slurm/failure.py) never
requeues it, on the real cluster. The workers' own stop path is covered in test_fsdp_slurm.py."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import wait_for

from fsdpjob.orchestrator.core.runfolder.paths import RunPaths
from fsdpjob.orchestrator.core.runfolder.runmeta import RunMeta
from fsdpjob.orchestrator.slurm import commands as slurm_cli

pytestmark = [pytest.mark.slow]

# Stands in for fsdpjob's batch script after its workers died of the cancel's SIGTERM: srun failed, so the
# script asks the failure policy whether to requeue. The run folder says the attempt trained (it would be
# requeued after a crash), so only the cancel check keeps the job from coming back.
BATCH = """\
#!/bin/bash
on_term() {{
    {python} -m fsdpjob.orchestrator.slurm.failure {run_dir} 1 2>{run_dir}/policy.err
    echo "policy rc=$?" >>{run_dir}/policy.err
    exit 1
}}
trap on_term TERM
echo started >{run_dir}/started
for _ in $(seq 1500); do sleep 0.2; done
"""


def trained_run(run_dir: Path) -> None:
    run_dir.mkdir()
    RunMeta(spec={"preemption": {"max_requeues": 5}}).write(RunPaths(run_dir))
    t = time.time()
    events = [{"event": "start", "restart": 0, "time": t}, {"event": "ready", "step": 0, "time": t + 1}]
    (run_dir / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    (run_dir / "metrics.jsonl").write_text(json.dumps({"step": 5, "loss": 1.0, "time": t + 2}) + "\n")


def settled_state(job_id: str) -> str:
    def ended():
        state = slurm_cli.job_state(job_id)
        return state if state not in ("RUNNING", "COMPLETING", "PENDING") else None

    return wait_for(ended, timeout_s=60, interval_s=0.5, what=f"job {job_id} to end")


@pytest.mark.parametrize("how", ["scancel", "fsdpjob-cancel"])
def test_failure_policy_leaves_a_cancelled_job_cancelled(slurm_cluster, tmp_path, how):
    run_dir = tmp_path / "run"
    trained_run(run_dir)
    script = tmp_path / "batch.sh"
    script.write_text(BATCH.format(python=sys.executable, run_dir=run_dir))
    job_id = subprocess.run(["sbatch", "--parsable", "--requeue", f"--output={tmp_path}/out", str(script)],
                            capture_output=True, text=True, check=True).stdout.strip()
    wait_for(lambda: (run_dir / "started").exists(), timeout_s=60, interval_s=0.5, what="the batch script to start")
    if how == "scancel":
        subprocess.run(["scancel", job_id], check=True)  # requeue stays on: sacct says CANCELLED
    else:
        slurm_cli.scancel(job_id)  # what `fsdpjob cancel` runs: requeue off, then scancel
    wait_for(lambda: "policy rc=" in (run_dir / "policy.err").read_text() if (run_dir / "policy.err").exists()
             else None, timeout_s=60, interval_s=0.5, what="the failure policy to run")
    assert settled_state(job_id) == "CANCELLED"
    err = (run_dir / "policy.err").read_text()
    assert "not requeueing it" in err and "policy rc=0" in err, err
    events = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]
    assert not [e for e in events if e["event"] == "requeue"], events
    time.sleep(2)
    assert slurm_cli.job_state(job_id) == "CANCELLED"  # not back in the queue
