"""Start a local run under the supervisor: submitit's local executor pickles the job as always, but the
process it starts is the supervisor, which runs submitit's controller (and so the ranks) as its child and
restarts it after a crash or a hang, like the batch script's supervisor does with srun on Slurm."""

from __future__ import annotations

import os
import subprocess
import sys

import submitit
from submitit.local.local import LocalJob


class SupervisedLocalExecutor(submitit.LocalExecutor):
    """submitit's LocalExecutor with the supervisor between it and its controller; the job id is the
    supervisor's pid (the controller names the job by its parent: SUBMITIT_LOCAL_WITH_SHELL)."""

    def __init__(self, folder: str, run_dir: str):
        super().__init__(folder=folder)
        self.run_dir = run_dir

    def _submit_command(self, command: str) -> LocalJob:
        ntasks = self.parameters.get("tasks_per_node", 1)
        env = {
            **os.environ,
            # What submitit.local.local.start_controller sets for its controller.
            "SUBMITIT_LOCAL_NTASKS": str(ntasks),
            "SUBMITIT_LOCAL_COMMAND": command,
            "SUBMITIT_LOCAL_TIMEOUT_S": str(int(60 * self.parameters.get("timeout_min", 2.0))),
            "SUBMITIT_LOCAL_SIGNAL_DELAY_S": str(int(self.parameters.get("signal_delay_s", 30))),
            "SUBMITIT_LOCAL_NODEID": "0",
            "SUBMITIT_LOCAL_JOB_NUM_NODES": "1",
            "SUBMITIT_STDERR_TO_STDOUT": "",
            "SUBMITIT_EXECUTOR": "local",
            "CUDA_VISIBLE_DEVICES": "",
            # The controller then takes its parent's pid (the supervisor's) as the job id, on every restart.
            "SUBMITIT_LOCAL_WITH_SHELL": "1",
        }
        argv = [sys.executable, "-m", "fsdpjob.orchestrator.supervise", self.run_dir, "--world-size", str(ntasks),
                "--scheduler", "local", "--", sys.executable, "-m", "submitit.local._local", str(self.folder)]
        log = open(self.folder / "supervisor.log", "ab")  # its fds 1-2 are /dev/null (local backend)
        with log:
            process = subprocess.Popen(argv, env=env, stdout=log, stderr=log)  # noqa: S603 - fixed argv, no shell
        return LocalJob(folder=self.folder, job_id=str(process.pid), process=process, tasks=list(range(ntasks)))
