"""A stop on a SIGTERM that neither Slurm's preemption nor its time limit sent (srun's teardown of the step after a
task's shell ended) restarts the workers in the allocation; a SIGTERM the batch step got as well (Slurm's) settles
as before: classified and requeued. A real Supervisor (scheduler slurm) around a real step process; the only fakes
are the `scontrol` answers on PATH (a running job; each call logged), as no Slurm controller runs here."""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

import pytest

from fsdpjob.orchestrator.core.jobspec.spec import JobSpec
from fsdpjob.orchestrator.core.runfolder import runlog
from fsdpjob.orchestrator.core.runfolder.paths import RunPaths
from fsdpjob.orchestrator.core.runfolder.runmeta import RunMeta
from fsdpjob.orchestrator.supervise.run import Supervisor

SCONTROL = """#!/bin/sh
echo "$*" >> "$SCONTROL_LOG"
case "$1 $2" in
  "show hostnames") echo n1 ;;
  "show job") echo "JobId=7 JobName=sup JobState=RUNNING Restarts=0 PreemptTime=None" ;;
esac
"""

# The step: launch 0 stops as the workers do after a SIGTERM (a committed stop checkpoint at step 3, handed over
# in stop.json, exit 0); with ``term_supervisor``, Slurm's SIGTERM reaches the batch step (the supervisor) too,
# first. Launch 1 finishes the run.
STEP = """import os, signal, sys, time
from pathlib import Path
from fsdpjob.orchestrator.core.runfolder import runlog, stophandoff
run_dir, launch = Path(sys.argv[1]), int(os.environ["FSDPJOB_LAUNCH"])
if launch == 0:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the ranks' handler only notes it
    if sys.argv[2] == "1":
        os.kill(os.getppid(), signal.SIGTERM)
        time.sleep(0.5)
    stophandoff.write(run_dir, stophandoff.StopHandoff(launch=0, step=3, signal=15, save_s=0.5,
                                                       signal_to_commit_s=1.0, committed_at=time.time()))
else:
    runlog.append(run_dir, runlog.DONE, step=5)
"""


@pytest.fixture
def slurm_here(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    scontrol = bin_dir / "scontrol"
    scontrol.write_text(SCONTROL)
    scontrol.chmod(scontrol.stat().st_mode | stat.S_IEXEC)
    log = tmp_path / "scontrol.log"
    log.touch()
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("SCONTROL_LOG", str(log))
    for name, value in {"SLURM_JOB_ID": "7", "SLURM_JOB_NUM_NODES": "1", "SLURM_JOB_NODELIST": "n1",
                        "SLURM_RESTART_COUNT": "0"}.items():
        monkeypatch.setenv(name, value)
    return log


def _supervise(run_dir: Path, term_supervisor: bool) -> tuple[int, list[dict]]:
    spec = JobSpec.model_validate({"name": "sup", "model": {"path": "/m"}, "data": {"path": "/d.jsonl"},
                                   "train": {"max_steps": 5}})
    RunMeta.of(spec).write(RunPaths(run_dir))
    command = [sys.executable, "-c", STEP, str(run_dir), "1" if term_supervisor else "0"]
    rc = Supervisor(run_dir, command, world_size=1, scheduler="slurm").run()
    return rc, runlog.timeline(run_dir)


def test_a_sigterm_only_the_step_got_restarts_the_workers_in_the_allocation(tmp_path, slurm_here):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    rc, events = _supervise(run_dir, term_supervisor=False)
    assert rc == 0
    # The relaunch (launch 1) after the stop, in this allocation: the GPU-free wait between them, as after a crash.
    assert [(e["event"], e.get("launch")) for e in events] == [("stop", None), ("gpu_wait", 1), ("done", None)]
    stop = events[0]
    assert (stop["reason"], stop["requeued"], stop.get("restarted")) == ("teardown", False, True), stop
    assert "requeue" not in slurm_here.read_text()  # the job never left its allocation


def test_a_sigterm_the_batch_step_got_too_is_slurms_and_requeues(tmp_path, slurm_here):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    rc, events = _supervise(run_dir, term_supervisor=True)
    assert rc == 0
    assert [e["event"] for e in events] == ["stop"]
    assert (events[0]["reason"], events[0]["requeued"]) == ("time_limit", True), events[0]
    assert "requeue 7" in slurm_here.read_text()
