"""Training FLOPs per token: the one formula the planner's step time and the worker's MFU share (no torch)."""

from __future__ import annotations


def train_flops_per_token(*, matmul_params: int, trained_params: int, layers: int, q_dim: int, seq_len: int,
                          recompute: bool = False) -> float:
    """Forward + backward FLOPs of one token.

    Forward: 2 per matmul weight (the input embedding lookup is none; a tied output projection is) plus causal
    attention, half of 4 x layers x seq_len x q_dim for QK^T and AV. Backward: twice the forward, less the weight
    gradients of frozen weights (LoRA's base: ~4N where full training is 6N). ``recompute``: activation
    checkpointing runs the forward twice (hardware FLOPs for a step time; MFU leaves it out).
    """
    forward = forward_flops_per_token(matmul_params, layers, q_dim, seq_len)
    per_token = 3 * forward - 2 * max(matmul_params - trained_params, 0)
    return float(per_token + forward * recompute)


def forward_flops_per_token(matmul_params: int, layers: int, q_dim: int, seq_len: int) -> int:
    """A forward pass's FLOPs per token (train_flops_per_token's forward; a frozen reference model's whole cost)."""
    return 2 * matmul_params + 2 * layers * seq_len * q_dim


# Dense peaks per accelerator from the vendors' datasheets, FLOP/s: (bf16 tensor cores, fp32 without TF32 as torch
# computes fp32 matmuls by default). The one table the planner's step time (by the profile's gpu_type) and the
# worker's MFU (by torch's device name) read. Matched as substrings of the normalised name, most specific first:
# the PCIe and NVL cards run lower clocks and power than the SXM ones of the same name.
PEAK_FLOPS: tuple[tuple[str, float, float], ...] = (
    ("h100 pcie", 756e12, 51e12),
    ("h100 nvl", 835e12, 60e12),
    ("h100", 989e12, 67e12),
    ("h200 nvl", 835e12, 60e12),
    ("gh200", 989e12, 67e12),  # Grace Hopper: the H100 SXM's tensor cores (torch names it "NVIDIA GH200 480GB")
    ("h200", 989e12, 67e12),
    ("h800 pcie", 756e12, 51e12),
    ("h800", 989e12, 67e12),
    ("h20", 148e12, 44e12),
    ("gb200", 2500e12, 80e12),
    ("b200", 2250e12, 80e12),
    ("a100", 312e12, 19.5e12),
    ("a800", 312e12, 19.5e12),
    ("l40s", 362e12, 91.6e12),
    ("l40", 181e12, 90.5e12),
    ("l4", 121e12, 30.3e12),
    ("mi300x", 1307e12, 163.4e12),
)


def peak_flops(name: str, dtype_bytes: int = 2) -> float | None:
    """The dense peak of the accelerator ``name`` names (a profile's gpu_type such as 'H100-PCIe-80GB', or torch's
    'NVIDIA H100 PCIe') for bf16 (2) or fp32 (4) compute; None when the table does not know it. Whole words match,
    so 'l40' is not read in 'l40s' nor 'h100' in 'h1000'."""
    words = f" {' '.join(name.lower().replace('-', ' ').replace('_', ' ').split())} "
    for match, bf16, fp32 in PEAK_FLOPS:
        if f" {match} " in words:
            return bf16 if dtype_bytes == 2 else fp32
    return None
