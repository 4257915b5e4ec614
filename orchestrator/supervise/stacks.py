"""Every rank's Python stacks at a stall, by py-spy, one file per rank in the run folder.

py-spy reads a process's memory without stopping it (``--nonblocking``), so it works on a rank that is
frozen by SIGSTOP or stuck in C code. A rank on this machine is dumped directly; one on another node through
``srun --overlap`` into the running job (slurm/commands.py).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from fsdpjob.orchestrator.core.errors import FsdpjobError
from fsdpjob.orchestrator.core.runfolder.heartbeat import Beat
from fsdpjob.orchestrator.slurm import commands as slurm_cli

DUMP_TIMEOUT_S = 20


def stacks_dir(run_dir: Path | str) -> Path:
    return Path(run_dir) / "stacks"


def pyspy() -> str | None:
    """py-spy next to this Python (the venv the job runs in), else on PATH."""
    beside = Path(sys.executable).parent / "py-spy"
    return str(beside) if beside.exists() else shutil.which("py-spy")


def _dump_one(beat: Beat, job_id: str | None) -> str:
    exe = pyspy()
    if exe is None:
        return "py-spy not found: install fsdpjob's dependencies in the job's environment (pip install py-spy)"
    argv = [exe, "dump", "--pid", str(beat.pid), "--nonblocking"]
    try:
        if beat.machine == os.uname().nodename:
            proc = subprocess.run(argv, capture_output=True, text=True, timeout=DUMP_TIMEOUT_S, check=False)
            return proc.stdout + (proc.stderr if proc.returncode else "")
        if job_id is None:
            return f"rank {beat.rank} runs on {beat.machine}, another machine, outside a Slurm job: not dumped"
        return slurm_cli.on_node(job_id, beat.host, argv, timeout=DUMP_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired, FsdpjobError) as exc:
        return f"py-spy dump of rank {beat.rank} (pid {beat.pid} on {beat.host}) failed: {exc}"


def top_frame(dump: str) -> str | None:
    """The innermost frame of the main thread: ``function (file:line)``."""
    lines = dump.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("Thread") and '"MainThread"' in line:
            frames = [f.strip() for f in lines[i + 1:] if f.startswith(" ")]
            return frames[0] if frames else None
    return None


def dump_all(beats: list[Beat], out: Path, *, job_id: str | None) -> dict[int, str | None]:
    """Write ``out/rank-<R>.txt`` for every rank; returns each rank's top frame."""
    out.mkdir(parents=True, exist_ok=True)
    with ThreadPoolExecutor(max_workers=min(16, max(1, len(beats)))) as pool:
        dumps = list(pool.map(lambda b: _dump_one(b, job_id), beats))
    tops = {}
    for beat, text in zip(beats, dumps):
        header = f"# rank {beat.rank} pid {beat.pid} on {beat.host}: step {beat.step}, phase {beat.phase!r}\n"
        (out / f"rank-{beat.rank}.txt").write_text(header + text, encoding="utf-8")
        tops[beat.rank] = top_frame(text)
    return tops
