"""Rank-0 progress reporting: which steps are logged and their window figures, console lines, metrics.jsonl,
events.jsonl, TensorBoard when installed, and the spec's W&B and MLflow trackers; MFU, with the model's FLOPs per
token and the device's peak."""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from fsdpjob.orchestrator.core.flops import peak_flops, train_flops_per_token
from fsdpjob.orchestrator.core.runfolder import runlog

if TYPE_CHECKING:
    from fsdpjob.orchestrator.core.jobspec.spec import JobSpec

    from ..step import StepValues
    from .trackers import Trackers

log = logging.getLogger("fsdpjob.train")


def reset_peak_memory(device: torch.device) -> None:
    """Start the CUDA peaks at the training loop: set-up (the rank-0 load broadcast, a DCP load) spikes above
    the steady state the planner predicts. The CPU's VmHWM cannot be reset here (bench/memory_scaling.py)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def memory_figures(device: torch.device) -> dict[str, float]:
    """The logged memory figures. On CUDA: ``peak_mem_mb`` allocated by tensors and ``peak_reserved_mb`` held by
    the caching allocator (fragmentation included: what the planner's peak compares to), both since the loop
    began, and ``device_used_mb`` in use on the device now by every process (total - free: reserved plus the
    CUDA context, cuBLAS and NCCL buffers, other processes' contexts). On CPU: ``peak_mem_mb`` only."""
    if device.type != "cuda":
        return {"peak_mem_mb": peak_memory_mb(device)}
    free, total = torch.cuda.mem_get_info(device)
    return {"peak_mem_mb": peak_memory_mb(device), "peak_reserved_mb": torch.cuda.max_memory_reserved(device) / 2**20,
            "device_used_mb": (total - free) / 2**20}  # fmt: skip


def peak_memory_mb(device: torch.device) -> float:
    """CUDA allocator peak (allocated, since the last reset_peak_memory) on GPU; peak resident set (VmHWM) of this
    process on CPU."""
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
    return flops_per_token * tokens / seconds / (device_peak_flops(device) * world_size)


def model_flops_per_token(config: Any, *, seq_len: int | None = None, trained_params: int | None = None) -> float:
    """Training FLOPs per token for MFU, by the planner's formula (orchestrator/core/flops.py): 6 per trained
    matmul weight, 4 per frozen one (``trained_params``: the trainable parameters, e.g. LoRA's adapters; None:
    every weight trains), plus causal attention when ``seq_len`` is given (it grows with the context, so pass
    the training seq_len). Activation checkpointing's recompute is not counted (model FLOPs, not hardware).

    Input-embedding lookups cost no FLOPs; the output projection counts even when tied to them. MoE: the routed
    experts count top_k of them, as the planner does (orchestrator/planner/moe.py).
    """
    from transformers import AutoModelForCausalLM  # only here: the reporter itself runs without it

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    matmul_params = sum(
        p.numel() for m in model.modules() if not isinstance(m, nn.Embedding) for p in m.parameters(recurse=False)
    )
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    matmul_params -= inactive_expert_params(model, getattr(text, "num_experts_per_tok", None))
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    return train_flops_per_token(
        matmul_params=matmul_params, trained_params=matmul_params if trained_params is None else trained_params,
        layers=text.num_hidden_layers, q_dim=text.num_attention_heads * head_dim, seq_len=seq_len or 0,
    )


def inactive_expert_params(model: nn.Module, top_k: int | None) -> int:
    """MoE: the routed experts' parameters a token skips (transformers 5 stacks each layer's experts in 3-D
    tensors under ``.experts.``, the expert first): all but ``top_k`` of them; 0 for dense models."""
    if not top_k:
        return 0
    skipped = 0
    for name, p in model.named_parameters():
        if ".experts." in name and "shared_expert" not in name and p.dim() >= 2 and p.shape[0] > top_k:
            skipped += p.numel() * (p.shape[0] - top_k) // p.shape[0]
    return skipped


def peak_flops_for_name(device_name: str) -> float:
    """Dense bf16 peak of the named accelerator (core/flops.PEAK_FLOPS); NaN when it is not in the table (MFU then
    reads nan)."""
    peak = peak_flops(device_name)
    return math.nan if peak is None else peak


def device_peak_flops(device: torch.device) -> float:
    """Dense bf16 peak of one CUDA device, for MFU."""
    return peak_flops_for_name(torch.cuda.get_device_name(device))


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
            except Exception:  # TensorBoard is optional
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

    def ending(self, name: str) -> None:
        """Tell the trackers how the run ends (a stop event someone else records: core/runfolder/stophandoff.py)."""
        if self.enabled and self._trackers is not None:
            self._trackers.on_event(name)

    def begin_training(self, step: int, *, flops_per_token: float, device: torch.device, world_size: int) -> None:
        """Open the first log window at ``step``, where this start trains from."""
        self._flops_per_token, self._device, self._world_size = flops_per_token, device, world_size
        reset_peak_memory(device)
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
            "loss": values.loss, **values.extra(), "lr": lr, "grad_norm": values.grad_norm, "tokens": tokens_seen,
            "tokens_per_s": window_tokens / max(elapsed, 1e-9),
            "mfu": mfu(self._flops_per_token, window_tokens, elapsed, self._device, self._world_size),
            **memory_figures(self._device),
        }, step_time_s=elapsed / steps)
        self._window_start, self._window_step, self._window_tokens = now, step, 0

    def on_eval(self, step: int, loss: float, tokens: int, seconds: float,
                extra: dict[str, float] | None = None) -> None:
        """Log an evaluation on its own metrics line (``step``, ``time``, ``eval_loss``, ``eval_tokens``,
        ``eval_s``, and a method's ``extra``: preference training's ``eval_rewards/accuracies`` ...) and as eval/loss
        (eval/rewards/accuracies ...). Its time is left out of the open window's throughput. ``tokens``: what the
        evaluation counted (target tokens; a preference evaluation's examples)."""
        self._window_start += seconds
        if not self.enabled:
            return
        finite = loss if math.isfinite(loss) else None
        extra = {k: v for k, v in (extra or {}).items() if math.isfinite(v)}
        record = {"step": step, "time": time.time(), "eval_loss": finite, "eval_tokens": tokens,
                  "eval_s": round(seconds, 3), **extra}
        if finite is None:
            record["nonfinite"] = ["eval_loss"]
        runlog.append_metric(self.run_dir, record)
        named = {"eval/" + k.removeprefix("eval_"): v for k, v in extra.items()}
        if self._tb is not None and finite is not None:
            for key, value in {"eval/loss": finite, **named}.items():
                self._tb.add_scalar(key, value, step)
        if self._trackers is not None and finite is not None:
            self._trackers.log(step, {"eval/loss": finite, **named})
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
