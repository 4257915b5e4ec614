"""The callable submitit pickles and runs in every task, and the login node's other doors into the worker side
(in-process export, the quickstart's assets). Imports torch only when called."""

from __future__ import annotations

from pathlib import Path


class TrainJob:
    """Run the training worker for one run folder. Resume state comes from disk, not from this object."""

    def __init__(self, run_dir: str):
        self.run_dir = run_dir

    def __call__(self) -> dict:
        # First thing, before torch and transformers load (seconds): submitit's handlers are live from
        # here on and would swallow a SIGTERM (an external requeue or cancel) or the warning signal that
        # lands during those imports; the job would then train on until Slurm's SIGKILL and lose steps.
        from fsdpjob.orchestrator.core.runfolder.runmeta import stop_signal

        from . import workerenv
        from .preemption import StopFlag

        workerenv.entered()  # the launch ends here for the goodput report, whatever the process's age

        stop = StopFlag(stop_signal(self.run_dir))
        _start_heartbeat(self.run_dir)  # before the heavy imports too: a hang there is a setup hang
        from .train import run

        try:
            result = run(self.run_dir, stop=stop)
        except SystemExit:  # every rank leaves together after a stop checkpoint (preemption.exit_after_stop)
            _heartbeat_exited()
            raise
        except BaseException:  # a crash: run() aborted the process group; the exit joins no writer thread
            workerenv.leave_without_joining_writers()
            raise
        _heartbeat_exited()
        return result

    def checkpoint(self, *args, **kwargs):
        """submitit's requeue hook. fsdpjob replaces submitit's signal handlers on every rank, so this only
        runs if that failed; resubmitting the same job is right because resume is driven by disk."""
        import submitit

        return submitit.helpers.DelayedSubmission(TrainJob(self.run_dir))

    def __repr__(self) -> str:
        return f"TrainJob({self.run_dir!r})"


def _start_heartbeat(run_dir: str) -> None:
    """Under the in-allocation supervisor (orchestrator/supervise), start this rank's heartbeat thread."""
    from .workerenv import WorkerEnv

    worker = WorkerEnv.from_env()
    if not worker.supervised:
        return
    from fsdpjob.orchestrator.core.runfolder import heartbeat

    heartbeat.start(run_dir, rank=int(worker.log_rank), launch=worker.launch)


def _heartbeat_exited() -> None:
    from fsdpjob.orchestrator.core.runfolder import heartbeat

    heartbeat.current().exited()


# -- the login node's other doors into the worker side (orchestrator/ imports jobs/ only through this module) ------

class ExportFailed(Exception):
    """A checkpoint the exporter could not read or write (the worker's CheckpointError, carried across the seam)."""


def export_model(path: Path, out: Path, dtype: str, *, merge: bool) -> Path:
    """`fsdpjob export` without --submit: the worker's exporter in this process (torch loads here). Returns the
    step folder exported; raises ExportFailed for a checkpoint it cannot export."""
    from .checkpoint import CheckpointError
    from .export import export_from_path

    try:
        return export_from_path(path, out, dtype, merge=merge)
    except CheckpointError as exc:
        raise ExportFailed(str(exc)) from None


def make_quickstart(out_dir: str | Path) -> dict[str, str]:
    """`fsdpjob quickstart`: the tiny Llama model, tokenizer and data set (jobs/quickstart.py; torch loads here)."""
    from .quickstart import make_quickstart as make

    return make(out_dir)
