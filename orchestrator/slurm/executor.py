"""The single submitit contract point: a SlurmExecutor whose sbatch script is fsdpjob's jinja2 template."""

from __future__ import annotations

from pathlib import Path

import submitit

from .render import SbatchPlan, render_script


class FsdpjobSlurmExecutor(submitit.SlurmExecutor):
    """submitit keeps pickling, job ids and result files; fsdpjob owns the script text.

    submitit calls ``_make_submission_file_text(command, uid)`` with its own task command
    (``python -u -m submitit.core._submit <folder>``); we put that command into our srun line.
    """

    def __init__(self, folder: str | Path, *, plan: SbatchPlan, python: str):
        # max_num_timeout is submitit's own requeue countdown; fsdpjob's workers replace submitit's
        # signal handlers and enforce preemption.max_requeues themselves.
        super().__init__(folder=folder, max_num_timeout=1000, python=python)
        self._plan = plan

    def _make_submission_file_text(self, command: str, uid: str) -> str:
        return render_script(self._plan.with_command(command))
