"""Loaded first by every Python process of a vLLM server fsdpjob starts (its PYTHONPATH leads here; the engine and
worker processes vLLM spawns inherit it): SIGTERM, SIGUSR1 and SIGUSR2 are ignored, and handlers vLLM or uvicorn
install for them later are not installed. Slurm sends them to every step of a preempted job (SIGUSR2: fsdpjob's
--signal lead, whose default action ends a process: seen on the dev cluster), and vLLM would exit while the ranks
may still ask it for a round before their stop checkpoint (a crash, not a stop); this package's own server ignores
the same three. The supervisor stops the server with SIGINT, then SIGKILL (supervise/genserver.py)."""

import signal

_install = signal.signal


_IGNORED = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)


def _signal(signum, handler):
    if signum in _IGNORED:
        return signal.SIG_IGN
    return _install(signum, handler)


for _sig in _IGNORED:
    _install(_sig, signal.SIG_IGN)
signal.signal = _signal
