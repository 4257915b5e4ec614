"""Before a relaunch in the same allocation: wait until the crashed step's processes have let go of the GPUs.

A rank killed by srun (or the local controller) leaves its CUDA context until the driver tears it down, which
can take seconds on a large context. A relaunch that starts before that fails at CUDA init on EXCLUSIVE_PROCESS
nodes ("device busy") or runs out of memory at set-up: one more fault for nothing. So the supervisor polls each
node's compute apps (``nvidia-smi --query-compute-apps``, on Slurm through ``srun --overlap``) until none is left
or the bound passes, and records the wait (a ``gpu_wait`` event). Nodes without nvidia-smi (CPU nodes, the dev
cluster) are skipped at once. A probe that cannot see the node's GPUs (nvidia-smi's "No devices were found", exit
6: a site whose probe step gets no GPUs) is not waited for either, but the event names those nodes: an empty
list there is not a free GPU.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

GPU_FREE_BOUND_S = 60.0  # longest wait before relaunching anyway (the relaunch's own fault then says why)
GPU_FREE_POLL_S = 1.0
NO_NVIDIA_SMI = "no nvidia-smi"
NO_DEVICES = "No devices were found"  # nvidia-smi's words (exit 6) where the process sees no GPU
NO_GPUS_SEEN = "no GPUs seen"
# Compute apps still holding a GPU (one line each: pid, MiB), or a marker where the node has no nvidia-smi or
# the probe sees no GPU (nvidia-smi's exit 6, or its words on stdout whatever the exit).
QUERY = ("command -v nvidia-smi >/dev/null 2>&1 || { echo '" + NO_NVIDIA_SMI + "'; exit 0; }; "
         "out=$(nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits); rc=$?; "
         "case \"$rc $out\" in '6 '*|*'" + NO_DEVICES + "'*) echo '" + NO_GPUS_SEEN + "'; exit 0;; esac; "
         "[ -z \"$out\" ] || printf '%s\\n' \"$out\"; exit $rc")

Apps = Callable[[str], str]  # node -> QUERY's output there (raises where the probe itself fails)


@dataclass(frozen=True)
class GpuWait:
    waited_s: float
    busy: dict[str, list[str]]  # node -> the compute apps still there when the wait ended (empty: all free)
    skipped: tuple[str, ...]  # nodes without nvidia-smi (or whose probe failed): not waited for
    no_gpus_seen: tuple[str, ...] = ()  # nodes whose probe step saw no GPU: not waited for, and said so

    def fields(self) -> dict:
        return {"waited_s": round(self.waited_s, 2), "busy": self.busy, "skipped": list(self.skipped),
                "no_gpus_seen": list(self.no_gpus_seen)}


def compute_apps(output: str) -> list[str] | str:
    """The compute apps in QUERY's output (one "pid, MiB" line each), or why there are none to wait for:
    NO_NVIDIA_SMI or NO_GPUS_SEEN."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    if lines in ([NO_NVIDIA_SMI], [NO_GPUS_SEEN]):
        return lines[0]
    if any(NO_DEVICES in line for line in lines):
        return NO_GPUS_SEEN
    return [line for line in lines if "No running processes" not in line]


def wait_gpus_free(nodes: list[str], apps: Apps, *, bound_s: float = GPU_FREE_BOUND_S,
                   poll_s: float = GPU_FREE_POLL_S, clock: Callable[[], float] = time.monotonic,
                   sleep: Callable[[float], None] = time.sleep) -> GpuWait:
    """Poll ``nodes`` (in parallel) until no compute app is left on any, or ``bound_s`` passed."""
    started = clock()
    skipped: list[str] = []
    unseen: list[str] = []
    waiting = list(nodes)
    busy: dict[str, list[str]] = {}

    def probe(node: str) -> list[str] | str:
        try:
            return compute_apps(apps(node))
        except Exception:  # a probe that fails (node gone, srun refused) cannot be waited for
            return "probe failed"

    with ThreadPoolExecutor(max_workers=max(1, min(16, len(nodes)))) as pool:
        while waiting:
            found = dict(zip(waiting, pool.map(probe, waiting)))
            unseen += [n for n, a in found.items() if a == NO_GPUS_SEEN]
            skipped += [n for n, a in found.items() if isinstance(a, str) and a != NO_GPUS_SEEN]
            busy = {n: a for n, a in found.items() if isinstance(a, list) and a}
            waiting = list(busy)
            if not waiting or clock() - started >= bound_s:
                break
            sleep(poll_s)
    return GpuWait(clock() - started, busy, tuple(skipped), tuple(unseen))
