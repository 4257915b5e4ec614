"""The single submitit contract point: a SlurmExecutor whose sbatch script is fsdpjob's jinja2 template."""

from __future__ import annotations

from pathlib import Path

import submitit

from .render import SbatchParts, render_script


class FsdpjobSlurmExecutor(submitit.SlurmExecutor):
    """submitit keeps pickling, job ids and result files; fsdpjob owns the script text.

    submitit calls ``_make_submission_file_text(command, uid)`` with its own task command
    (``python -u -m submitit.core._submit <folder>``); we put that command into our srun line.
    """

    def __init__(self, folder: str | Path, *, plan: SbatchParts, python: str):
        # max_num_timeout is submitit's own requeue countdown; fsdpjob's workers replace submitit's
        # signal handlers and enforce preemption.max_requeues themselves.
        super().__init__(folder=folder, max_num_timeout=1000, python=python)
        self._plan = plan

    def _make_submission_file_text(self, command: str, uid: str) -> str:
        return render_script(self._plan.with_command(command))


class FsdpjobArrayExecutor(submitit.SlurmExecutor):
    """One sbatch of an array job (slurm/arrayrender.py) whose task i runs the job pickled in run folder i.

    submitit's own arrays render its default script (they copy the executor into a plain SlurmExecutor) and keep
    every pickle in one folder; here the script is fsdpjob's and each task's pickle sits in its own run folder's
    submitit/ as ``<array job>_<task>_submitted.pkl``, the name submitit's worker looks for in an array task.
    """

    def __init__(self, folder: str | Path, *, script: str):
        super().__init__(folder=folder, max_num_timeout=1000)  # as FsdpjobSlurmExecutor: the workers requeue
        self._script = script

    def _make_submission_file_text(self, command: str, uid: str) -> str:
        return self._script  # slurm/arrayrender.py's: it holds every task's command already

    def submit_array(self, jobs: list[tuple[Path, object]]) -> str:
        """(the task's submitit folder, its callable) per task, in index order -> the array job's id."""
        import uuid

        from submitit.core import utils

        timeout_min = self.parameters.get("time", 5)
        pickles = []
        for folder, fn in jobs:
            delayed = utils.DelayedSubmission(fn)
            delayed.set_timeout(timeout_min, self.max_num_timeout)
            path = Path(folder) / f".{uuid.uuid4().hex}.pkl"
            delayed.dump(path)
            pickles.append(path)
        job = self._submit_command("")
        # A task that starts before its pickle is in place waits for it (submitit's worker waits up to 60 s).
        for index, ((folder, _), path) in enumerate(zip(jobs, pickles)):
            path.rename(Path(folder) / f"{job.job_id}_{index}_submitted.pkl")
        return str(job.job_id)
