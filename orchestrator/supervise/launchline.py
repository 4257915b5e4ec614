"""What a local run starts, as data: the supervisor's command line, the environment submitit's controller
reads, and each rank's command. supervise/launch.py starts them; the dry run prints them."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path


def rank_command(submitit_dir: Path, python: str | None = None) -> str:
    """Each rank's command, as submitit's LocalExecutor writes it (its _submitit_command_str); ``python``: the
    workers' interpreter where it is not this one (grpo's vLLM colocated in them: generator.python)."""
    return " ".join([shlex.quote(python or sys.executable), "-u -m submitit.core._submit",
                     shlex.quote(str(submitit_dir))])


def supervisor_argv(run_dir: str, submitit_dir: Path, ntasks: int) -> list[str]:
    """The supervisor, which runs submitit's controller (and so the ranks) as its child and restarts it."""
    return [sys.executable, "-m", "fsdpjob.orchestrator.supervise", run_dir, "--world-size", str(ntasks),
            "--scheduler", "local", "--", sys.executable, "-m", "submitit.local._local", str(submitit_dir)]


def controller_env(ntasks: int, command: str, timeout_s: int, signal_delay_s: int) -> dict[str, str]:
    """What submitit.local.local.start_controller sets for its controller (the ranks inherit it)."""
    return {
        "SUBMITIT_LOCAL_NTASKS": str(ntasks),
        "SUBMITIT_LOCAL_COMMAND": command,
        "SUBMITIT_LOCAL_TIMEOUT_S": str(timeout_s),
        "SUBMITIT_LOCAL_SIGNAL_DELAY_S": str(signal_delay_s),
        "SUBMITIT_LOCAL_NODEID": "0",
        "SUBMITIT_LOCAL_JOB_NUM_NODES": "1",
        "SUBMITIT_STDERR_TO_STDOUT": "",
        "SUBMITIT_EXECUTOR": "local",
        "CUDA_VISIBLE_DEVICES": "",
        # The controller then takes its parent's pid (the supervisor's) as the job id, on every restart.
        "SUBMITIT_LOCAL_WITH_SHELL": "1",
    }


def describe(profile: str, run_dir: Path, submitit_dir: Path, ntasks: int, timeout_s: int, signal_delay_s: int,
             env: dict[str, str], secret: set[str], python: str | None = None) -> str:
    """The dry run's text: what starts, in order, and the environment the ranks get on top of this shell's
    (secret values shown as <secret>: they never reach a file or a terminal)."""
    command = rank_command(submitit_dir, python)
    env = {**env, **controller_env(ntasks, command, timeout_s, signal_delay_s)}
    lines = [
        f"# profile {profile!r} is local: no sbatch script; {ntasks} worker process(es) start on this machine "
        f"(submitit local executor), run folder {run_dir}",
        "# 1. the supervisor, in the background (it restarts the workers after a crash or a hang):",
        shlex.join(supervisor_argv(str(run_dir), submitit_dir, ntasks)),
        f"# 2. it starts submitit's controller, which starts each rank k = 0..{ntasks - 1} "
        "(SUBMITIT_LOCAL_GLOBALID=k, SUBMITIT_LOCAL_LOCALID=k) as:",
        command,
        "# environment of the workers, on top of this shell's:",
        *(f"export {k}={'<secret>' if k in secret else shlex.quote(v)}" for k, v in sorted(env.items())),
    ]
    return "\n".join(lines) + "\n"
