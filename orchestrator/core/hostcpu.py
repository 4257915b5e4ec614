"""What this machine's CPU can do, as the planner needs it for CPU workers (torch-free: /proc/cpuinfo).

torch multiplies bf16 matrices with oneDNN only where the CPU has AVX-512 with BW, VL and DQ (x86) or the bf16
extension (Arm) (ATen's ``mkldnn_bf16_device_check``); oneDNN then keeps ~10 MiB of buffers per process, which
a CPU without those instructions (an AVX2-only EPYC, say) never allocates. The planner runs where a ``local``
run trains; for a CPU Slurm profile the login node's CPU stands for the nodes' (the profile does not say).
"""

from __future__ import annotations

import functools
from pathlib import Path

ONEDNN_BF16_X86 = frozenset({"avx512bw", "avx512vl", "avx512dq"})


def cpu_flags(cpuinfo: str) -> frozenset[str]:
    """The first processor's feature flags (x86 ``flags``, Arm ``Features``)."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def onednn_bf16_from(flags: frozenset[str]) -> bool:
    return ONEDNN_BF16_X86 <= flags or "bf16" in flags


@functools.cache
def onednn_bf16() -> bool:
    """Whether torch runs bf16 matmuls through oneDNN on this machine's CPU (False where it cannot tell)."""
    try:
        return onednn_bf16_from(cpu_flags(Path("/proc/cpuinfo").read_text()))
    except OSError:
        return False
