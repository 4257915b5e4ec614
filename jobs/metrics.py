"""Rank-0 progress reporting: console lines, metrics.jsonl, events.jsonl, and TensorBoard when installed."""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path

import torch

from fsdpjob.orchestrator.core import runlog

log = logging.getLogger("fsdpjob.train")


def peak_memory_mb(device: torch.device) -> float:
    """CUDA allocator peak on GPU; peak resident set (VmHWM) of this process on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class Reporter:
    """Writes only on the main rank; every other rank gets a no-op reporter."""

    def __init__(self, run_dir: Path, *, enabled: bool, max_steps: int):
        self.enabled = enabled
        self.run_dir = run_dir
        self.max_steps = max_steps
        self._tb = None
        if enabled:
            try:
                from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

                self._tb = SummaryWriter(str(run_dir / "tensorboard"))
            except Exception:  # noqa: BLE001 - TensorBoard is optional
                self._tb = None

    def event(self, name: str, *, all_ranks: bool = False, **fields: object) -> None:
        """Append a lifecycle event; ``all_ranks`` lets any rank report (failures happen on any rank)."""
        if self.enabled or all_ranks:
            runlog.append(self.run_dir, name, **fields)
            log.info("%s %s", name, " ".join(f"{k}={v}" for k, v in fields.items()))

    def step(self, step: int, values: dict[str, float], step_time_s: float) -> None:
        if not self.enabled:
            return
        eta = (self.max_steps - step) * step_time_s
        # NaN/inf (MFU on an unknown GPU, a diverged loss) become null: strict JSON readers (jq) reject NaN.
        finite = {k: (v if v is None or math.isfinite(v) else None) for k, v in values.items()}
        record = {"step": step, "time": time.time(), "eta_s": round(eta, 1), **finite}
        if nonfinite := sorted(k for k, v in values.items() if v is not None and not math.isfinite(v)):
            record["nonfinite"] = nonfinite  # which nulls were NaN/inf, so a diverged loss stays visible
        runlog.append_metric(self.run_dir, record)
        if self._tb is not None:
            for key, value in finite.items():
                if value is not None:
                    self._tb.add_scalar(f"train/{key}", value, step)
        log.info(
            "step %d/%d loss %.4f lr %.3g grad_norm %.3g tok/s %.0f peak_mem %.0f MiB eta %s",
            step,
            self.max_steps,
            values["loss"],
            values["lr"],
            values["grad_norm"],
            values["tokens_per_s"],
            values["peak_mem_mb"],
            time.strftime("%H:%M:%S", time.gmtime(eta)),
        )

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
