"""The callable submitit pickles and runs in every task. Imports torch only when called."""

from __future__ import annotations


class TrainJob:
    """Run the training worker for one run folder. Resume state comes from disk, not from this object."""

    def __init__(self, run_dir: str):
        self.run_dir = run_dir

    def __call__(self) -> dict:
        from .train import run

        return run(self.run_dir)

    def checkpoint(self, *args, **kwargs):
        """submitit's requeue hook. fsdpjob replaces submitit's signal handlers on every rank, so this only
        runs if that failed; resubmitting the same job is right because resume is driven by disk."""
        import submitit

        return submitit.helpers.DelayedSubmission(TrainJob(self.run_dir))

    def __repr__(self) -> str:
        return f"TrainJob({self.run_dir!r})"
