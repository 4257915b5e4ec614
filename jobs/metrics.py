"""Rank-0 progress reporting: which steps are logged and their window figures, console lines, metrics.jsonl,
events.jsonl, TensorBoard when installed, and the spec's W&B and MLflow trackers."""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from fsdpjob.orchestrator.core import runlog

if TYPE_CHECKING:
    from fsdpjob.orchestrator.core.spec import JobSpec

    from .step import StepValues
    from .trackers import Trackers

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


def mfu(flops_per_token: float, tokens: int, seconds: float, device: torch.device, world_size: int) -> float:
    """Model FLOP utilisation on CUDA (bf16 dense peak of the device), 0 on CPU where no peak is defined."""
    if device.type != "cuda" or seconds <= 0:
        return 0.0
    from .model import device_peak_flops

    return flops_per_token * tokens / seconds / (device_peak_flops(device) * world_size)


class Reporter:
    """Writes only on the main rank; every other rank gets a no-op reporter.

    Training steps are logged in windows: step 1, every ``log_every`` steps and the last step. A logged
    step's throughput, MFU and step time are averages over the steps since the previous logged one.
    """

    def __init__(self, run_dir: Path, *, enabled: bool, max_steps: int, log_every: int = 1):
        self.enabled = enabled
        self._trackers: Trackers | None = None  # W&B and MLflow (open_trackers): the same scalars as TensorBoard
        self.run_dir = run_dir
        self.max_steps, self.log_every = max_steps, log_every
        self._flops_per_token, self._device, self._world_size = 0.0, torch.device("cpu"), 1
        self._window_start, self._window_step, self._window_tokens = time.time(), 0, 0
        self._tb = None
        if enabled:
            try:
                from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

                self._tb = SummaryWriter(str(run_dir / "tensorboard"))
            except Exception:  # noqa: BLE001 - TensorBoard is optional
                self._tb = None

    def open_trackers(self, spec: JobSpec) -> None:
        """Open the spec's W&B and MLflow runs on the main rank (continuing this run's, after a restart)."""
        if self.enabled:
            from .trackers import Trackers

            self._trackers = Trackers(spec, self.run_dir)

    def event(self, name: str, *, all_ranks: bool = False, **fields: object) -> None:
        """Append a lifecycle event; ``all_ranks`` lets any rank report (failures happen on any rank)."""
        if self.enabled or all_ranks:
            runlog.append(self.run_dir, name, **fields)
            if self._trackers is not None:
                self._trackers.on_event(name)
            log.info("%s %s", name, " ".join(f"{k}={v}" for k, v in fields.items()))

    def begin_training(self, step: int, *, flops_per_token: float, device: torch.device, world_size: int) -> None:
        """Open the first log window at ``step``, where this start trains from."""
        self._flops_per_token, self._device, self._world_size = flops_per_token, device, world_size
        self._window_start, self._window_step, self._window_tokens = time.time(), step, 0

    def on_step(self, step: int, values: StepValues, *, lr: float, tokens_seen: int) -> None:
        """Count a trained step into the window; log it when it closes one. Every rank calls this: reading the
        step's values is a collective, and only logged steps read them."""
        self._window_tokens += values.processed  # non-pad positions: what the device computed for real
        if step % self.log_every and step not in (1, self.max_steps):
            return
        now = time.time()
        elapsed, steps = now - self._window_start, max(1, step - self._window_step)
        window_tokens = self._window_tokens
        self.step(step, {
            "loss": values.loss, "lr": lr, "grad_norm": values.grad_norm, "tokens": tokens_seen,
            "tokens_per_s": window_tokens / max(elapsed, 1e-9),
            "mfu": mfu(self._flops_per_token, window_tokens, elapsed, self._device, self._world_size),
            "peak_mem_mb": peak_memory_mb(self._device),
        }, step_time_s=elapsed / steps)
        self._window_start, self._window_step, self._window_tokens = now, step, 0

    def on_eval(self, step: int, loss: float, tokens: int, seconds: float) -> None:
        """Log an evaluation on its own metrics line (``step``, ``time``, ``eval_loss``, ``eval_tokens``,
        ``eval_s``) and as eval/loss. Its time is left out of the open window's throughput."""
        self._window_start += seconds
        if not self.enabled:
            return
        finite = loss if math.isfinite(loss) else None
        record = {"step": step, "time": time.time(), "eval_loss": finite, "eval_tokens": tokens,
                  "eval_s": round(seconds, 3)}
        if finite is None:
            record["nonfinite"] = ["eval_loss"]
        runlog.append_metric(self.run_dir, record)
        if self._tb is not None and finite is not None:
            self._tb.add_scalar("eval/loss", finite, step)
        if self._trackers is not None and finite is not None:
            self._trackers.log(step, {"eval/loss": finite})
        log.info("step %d/%d eval_loss %.4f over %d tokens in %.1f s", step, self.max_steps, loss, tokens, seconds)

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
        if self._trackers is not None:
            self._trackers.log(step, {f"train/{key}": value for key, value in finite.items() if value is not None})
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
        if self._trackers is not None:
            self._trackers.close()
