"""Start a local run under the supervisor: submitit's local executor pickles the job as always, but the
process it starts is the supervisor, which runs submitit's controller (and so the ranks) as its child and
restarts it after a crash or a hang, like the batch script's supervisor does with srun on Slurm."""

from __future__ import annotations

import os
import shlex
import subprocess

import submitit
from submitit.local.local import LocalJob

from .launchline import controller_env, supervisor_argv


class SupervisedLocalExecutor(submitit.LocalExecutor):
    """submitit's LocalExecutor with the supervisor between it and its controller; the job id is the
    supervisor's pid (the controller names the job by its parent: SUBMITIT_LOCAL_WITH_SHELL)."""

    def __init__(self, folder: str, run_dir: str, python: str | None = None):
        super().__init__(folder=folder, python=None if python is None else shlex.quote(python))
        self.run_dir = run_dir

    def _submit_command(self, command: str) -> LocalJob:
        ntasks = self.parameters.get("tasks_per_node", 1)
        timeout_s = int(60 * self.parameters.get("timeout_min", 2.0))
        signal_delay_s = int(self.parameters.get("signal_delay_s", 30))
        env = {**os.environ, **controller_env(ntasks, command, timeout_s, signal_delay_s)}
        argv = supervisor_argv(self.run_dir, self.folder, ntasks)
        log = open(self.folder / "supervisor.log", "ab")  # its fds 1-2 are /dev/null (local backend)
        with log:
            # Its own session: the terminal's Ctrl-C and hang-up reach the CLI only (submit --wait turns Ctrl-C
            # into a cancel), never the workers as a KeyboardInterrupt that would read as a crash.
            process = subprocess.Popen(argv, env=env, stdout=log, stderr=log,  # fixed argv, no shell
                                       start_new_session=True)
        return LocalJob(folder=self.folder, job_id=str(process.pid), process=process, tasks=list(range(ntasks)))
