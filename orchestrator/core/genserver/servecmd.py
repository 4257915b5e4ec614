"""The command line of this package's own generation server (vLLM's is vllm.py's ``vllm_argv``).

Pure rendering (no torch, no subprocess): the supervisor puts the text in the server's srun step."""

from __future__ import annotations

from pathlib import Path


def server_argv(model: str | Path, *, host: str, port: int, dtype: str = "float32", device: str | None = None,
                ready_file: str | Path | None = None, threads: int | None = None,
                python: str = "python") -> list[str]:
    """``python -m fsdpjob.jobs.grpo.server ...``: this package's server (``threads``: pin torch's CPU threads,
    so that a restarted server samples bitwise as the one before)."""
    argv = [python, "-m", "fsdpjob.jobs.grpo.server", "--model", str(model), "--host", host, "--port", str(port),
            "--dtype", dtype]
    if device is not None:
        argv += ["--device", device]
    if ready_file is not None:
        argv += ["--ready-file", str(ready_file)]
    if threads is not None:
        argv += ["--threads", str(threads)]
    return argv
