"""The optimizer: torch's fused AdamW, or (train.optimizer_state_dtype: bfloat16) AdamW with its two moments kept in
bf16 beside fp32 parameters.

torch's AdamW keeps its moments in the parameters' dtype and its fused and foreach kernels take one dtype for
parameters, gradients and states, so bf16 moments with fp32 parameters need an optimizer of their own. torchao
(torchao.optim) is not a dependency of the workers and its bf16 option concerns bf16 parameters (stochastic
rounding), not fp32 parameters with bf16 states. Bf16StateAdamW is torch's single-tensor AdamW step (the same
operations in the same order, so with fp32 states it equals torch.optim.AdamW(foreach=False) bitwise; the tests
check that) done in fp32 on an fp32 copy of each parameter's moments, which are rounded back to bf16 (round to
nearest) after the step: the state memory is halved, the transient fp32 copies are one parameter shard's at a time.
The math runs on each DTensor's local shard (one op per tensor, not several DTensor dispatches per parameter);
the states stay DTensors shaped like their parameters, so distributed checkpoints save and reshard them as they
do torch's. Rounding to nearest means a second moment whose per-step change is under bf16's precision (2^-8
relative; beta2 above ~0.996) stops decaying between large gradients: updates come out smaller, never larger.

The learning-rate schedule (``lr_factor``): linear warmup, then cosine, linear or constant decay, a pure function
of the step.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch

_MOMENTS = ("exp_avg", "exp_avg_sq")


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (in place updates write through to it); a plain tensor as it is."""
    return t.to_local() if hasattr(t, "to_local") else t


class Bf16StateAdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay, torch's defaults and order of operations) whose exp_avg and exp_avg_sq are
    stored in ``state_dtype`` and updated in fp32."""

    def __init__(self, params: Iterable[Any], *, lr: float, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.01, state_dtype: torch.dtype = torch.bfloat16):
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay})
        self.state_dtype = state_dtype
        # torch's load_state_dict casts every floating state to its parameter's dtype (fp32 here): cast the
        # moments back, exactly (they were bf16 when saved), or a resumed run would carry fp32 moments on.
        self.register_load_state_dict_post_hook(Bf16StateAdamW._moments_to_state_dtype)

    def _moments_to_state_dtype(self) -> None:
        for state in self.state.values():
            for key in _MOMENTS:
                if key in state and state[key].dtype != self.state_dtype:
                    state[key] = state[key].to(self.state_dtype)

    def _state_of(self, param: torch.Tensor) -> dict[str, Any]:
        state = self.state[param]
        if not state:
            # A CPU step counter, as torch's non-fused AdamW keeps it: reading it never waits for the device.
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            for key in _MOMENTS:
                state[key] = torch.zeros_like(param, dtype=self.state_dtype, memory_format=torch.preserve_format)
        return state

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        if closure is not None:
            raise ValueError("Bf16StateAdamW.step takes no closure")
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self._state_of(param)
                state["step"] += 1
                _adamw_update(_local(param), _local(param.grad), _local(state["exp_avg"]),
                              _local(state["exp_avg_sq"]), step=state["step"].item(), lr=group["lr"], beta1=beta1,
                              beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"])


def _adamw_update(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *,
                  step: float, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float) -> None:
    """torch.optim.adamw's _single_tensor_adamw for one parameter (no amsgrad, no maximize), in fp32."""
    m, v, g = exp_avg.float(), exp_avg_sq.float(), grad.float()  # no copies where the states are fp32
    param.mul_(1 - lr * weight_decay)
    m.lerp_(g, 1 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    bias_correction2_sqrt = (1 - beta2**step) ** 0.5
    denom = (v.sqrt() / bias_correction2_sqrt).add_(eps)
    param.addcdiv_(m, denom, value=-(lr / (1 - beta1**step)))
    if m is not exp_avg:
        exp_avg.copy_(m)
        exp_avg_sq.copy_(v)


def build_optimizer(params: Iterable[torch.Tensor], train: Any) -> torch.optim.Optimizer:
    """The spec's optimizer (train: lr, betas, weight_decay, optimizer_state_dtype) over ``params``."""
    if train.optimizer_state_dtype == "bfloat16":
        return Bf16StateAdamW(params, lr=train.lr, betas=train.betas, weight_decay=train.weight_decay)
    # Fused on every device (torch has had a CPU kernel since 2.4): one kernel over all of this rank's shards,
    # where torch's default on CPU runs several DTensor ops per parameter (bench/RESULTS.md "Fused AdamW, fewer
    # ops around the step, and an in-process A/B"), and no temporaries (foreach AdamW, the default on CUDA,
    # holds one more shard-sized copy; the planner assumes none).
    return torch.optim.AdamW(params, lr=train.lr, betas=train.betas, weight_decay=train.weight_decay, fused=True)


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of this rank's moment states (their local shards)."""
    return sum(_local(s[k]).numel() * _local(s[k]).element_size()
               for s in optimizer.state.values() for k in _MOMENTS if k in s)


def lr_factor(step: int, *, max_steps: int, warmup_steps: int, schedule: str, min_lr_ratio: float) -> float:
    """Multiplier of the peak lr for optimizer step ``step`` (0-based, the step about to be taken)."""
    if warmup_steps and step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    span = max(1, max_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    if schedule == "linear":
        decay = 1.0 - progress
    elif schedule == "cosine":
        decay = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        raise ValueError(f"unknown lr_schedule {schedule!r}")
    return min_lr_ratio + (1.0 - min_lr_ratio) * decay
