"""Loaded first by every Python process of a vLLM server fsdpjob starts (its PYTHONPATH leads here; the engine and
worker processes vLLM spawns inherit it): SIGTERM is ignored, and handlers vLLM or uvicorn install for it later are
not installed. Slurm sends SIGTERM to every step of a preempted job, and vLLM would exit on it while the ranks may
still ask it for a round before their stop checkpoint (a crash, not a stop); this package's own server ignores it
the same way. The supervisor stops the server with SIGINT, then SIGKILL (supervise/genserver.py)."""

import signal

_install = signal.signal


def _signal(signum, handler):
    if signum == signal.SIGTERM:
        return signal.SIG_IGN
    return _install(signum, handler)


_install(signal.SIGTERM, signal.SIG_IGN)
signal.signal = _signal
