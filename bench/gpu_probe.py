"""What bench/gpu.py needs to know of the device, measured in a process of its own and printed as one JSON line.

    python bench/gpu_probe.py [--tiny] [--seq-len 2048]

The device's name, memory and nominal dense bf16 peak, the bf16 matmul rate it really delivers (an 8192^3 product,
3 warm-ups, then 10 timed: the ceiling MFU is also read against), and which SDPA kernels accept the bench's shape.
Its own process: the bench's parent never creates a CUDA context, so the cases' device-used memory (every
process's) holds only theirs. With --tiny (or no GPU): the CPU, and an fp32 matmul of 512^3 (checks the script).
"""

from __future__ import annotations

import argparse
import json
import time


def matmul_flops(device: str, size: int, dtype, warmups: int = 3, repeats: int = 10) -> float:
    """FLOP/s of a ``size``^3 matrix product: the mean of ``repeats`` products after ``warmups``."""
    import torch

    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    for _ in range(warmups):
        torch.mm(a, b)
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        torch.mm(a, b)
    if device == "cuda":
        torch.cuda.synchronize()
    return 2 * size**3 * repeats / (time.perf_counter() - start)


def sdpa_backends(seq: int) -> str:
    """Which SDPA kernels accept this shape in bf16 on this device (each tried alone): a probe of what can run."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = torch.randn(1, 16, seq, 128, device="cuda", dtype=torch.bfloat16)
    ok = []
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION):
        try:
            with sdpa_kernel([backend]):
                F.scaled_dot_product_attention(q, q, q, is_causal=True)
            ok.append(backend.name.lower())
        except RuntimeError:
            pass
    return "+".join(ok) or "math only"


def probe(tiny: bool, seq: int) -> dict:
    import torch

    from fsdpjob.jobs.report.metrics import peak_flops_for_name

    info = {"torch": torch.__version__, "cuda": torch.version.cuda}
    if tiny or not torch.cuda.is_available():
        return {**info, "device": "cpu", "name": "cpu", "total_memory_gib": None, "nominal_flops": None,
                "matmul_flops": matmul_flops("cpu", 512, torch.float32), "matmul": "fp32 512^3",
                "sdpa": "cpu"}  # fmt: skip
    name = torch.cuda.get_device_name(0)
    nominal = peak_flops_for_name(name)
    return {**info, "device": "cuda", "name": name,
            "total_memory_gib": torch.cuda.get_device_properties(0).total_memory / 2**30,
            "nominal_flops": None if nominal != nominal else nominal,  # NaN: a card the table lacks
            "matmul_flops": matmul_flops("cuda", 8192, torch.bfloat16), "matmul": "bf16 8192^3",
            "sdpa": sdpa_backends(seq)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--seq-len", type=int, default=2048)
    args = parser.parse_args()
    print(json.dumps(probe(args.tiny, args.seq_len)))


if __name__ == "__main__":
    main()
