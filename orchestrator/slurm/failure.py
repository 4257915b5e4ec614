"""The batch script's failure policy, Slurm's end: `python -m fsdpjob.orchestrator.slurm.failure RUN_DIR RC`
after srun failed (templates/sbatch.sh.j2). Slurm's facts (the restart count, the job id) and its requeue, through
commands.py; the decision and the record are the batch side's (supervise/failure.py)."""

from __future__ import annotations

import signal
import sys
from dataclasses import dataclass
from pathlib import Path

from fsdpjob.orchestrator.core import slurmenv
from fsdpjob.orchestrator.supervise.failure import after_crash

from . import commands as slurm_cli


@dataclass(frozen=True)
class SlurmRequeue:
    """This batch job, as the failure policy acts on it (supervise/failure.Requeue)."""

    job_id: str
    restarts: int

    def requeue_unless_cancelled(self) -> str | None:
        return slurm_cli.requeue_unless_cancelled(self.job_id)

    def exclude_nodes(self, nodes: list[str]) -> str:
        return slurm_cli.exclude_nodes(self.job_id, nodes)


def main(argv: list[str] | None = None) -> int:
    # `scontrol requeue` of our own running job makes Slurm SIGTERM this batch script at once: finish the
    # record (and the node exclusion) first; Slurm's KillWait leaves the time. (Only as the script's process.)
    if argv is None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    run_dir, exit_code = (argv or sys.argv[1:])[:2]
    job = SlurmRequeue(job_id=slurmenv.job_id_from_env() or "", restarts=slurmenv.restart_count())
    return after_crash(Path(run_dir), int(exit_code), job)


if __name__ == "__main__":
    sys.exit(main())
