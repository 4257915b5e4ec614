"""Each Slurm task's own exit, as the shell that runs it saw it (POSIX sh on the node, or in the container).

Who died first decides the crash blame (supervise/blame.py). srun's lines arrive in the order srun learnt of
each task's end, and across nodes that order races (a teardown line of one node printed before the line of the
rank that died first on the other); heartbeats and error times race too. The task's shell has a fact that
does not: it waits for the worker and, before it exits itself, writes the worker's exit status to
``<run>/heartbeat/exit-<rank>``. srun learns of a task's end only after that shell exits, so the first rank's
file is written before srun's ``--kill-on-bad-exit`` tears down anyone else; ranks killed by that teardown
(SIGKILL to every process of the step, the shell too) write none; ranks that fail on a dead peer write theirs
after their error event, which names the peer. The file's modification time orders the ranks (one shared file
system's clock for every node's file where it sets the times, e.g. NFS).

The shell also ignores SIGTERM and the stop signal (which the worker inherits ignored until it sets its own
handlers, first thing, in jobs/entry.py): Slurm signals every process of the step, and the shell must outlive
the signals the worker handles by saving, or srun would take the task for ended while it still writes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from .heartbeat import heartbeat_dir

SHELL_NAME = "fsdpjob-task"  # the shell's $0, as ps shows it
PREFIX = "exit-"


def task_shell(stop_signal: str) -> str:
    """The script of ``sh -c SCRIPT fsdpjob-task COMMAND...``. The supervisor creates the heartbeat folder before
    each launch and sets FSDPJOB_LAUNCH; srun sets SLURM_PROCID. A write that fails changes nothing else."""
    record = f"{heartbeat_dir('$FSDPJOB_RUN_DIR')}/{PREFIX}$SLURM_PROCID"
    return (f"trap '' TERM {stop_signal}; \"$@\"; rc=$?; "
            f"echo \"$FSDPJOB_LAUNCH $rc\" 2>/dev/null >\"{record}\"; exit $rc")


@dataclass(frozen=True)
class TaskExit:
    rank: int
    code: int  # the worker's exit status as sh gives it: 128 + N when signal N ended it
    time: float  # when the shell wrote it (the file's modification time)

    @property
    def signal(self) -> int | None:
        return self.code - 128 if self.code > 128 else None

    def describe(self) -> str:
        return f"killed by signal {self.signal}" if self.signal else f"exited with code {self.code}"


def read_task_exits(run_dir: Path | str, launch: int) -> list[TaskExit]:
    """The tasks of ``launch`` whose shell wrote their exit, earliest first; other launches' and torn files
    skipped."""
    found = []
    for path in heartbeat_dir(run_dir).glob(f"{PREFIX}*"):
        try:
            rank, (written, code) = int(path.name[len(PREFIX):]), path.read_text(encoding="utf-8").split()
            if int(written) == launch:
                found.append(TaskExit(rank, int(code), os.stat(path).st_mtime))
        except (OSError, ValueError):
            continue
    return sorted(found, key=lambda e: (e.time, e.rank))
