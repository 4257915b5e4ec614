"""A bare FSDP2 training loop, the baseline of bench/worker_throughput.py: launch it with torchrun.

    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 bench/bare_fsdp2.py --model DIR --data FILE.jsonl \
        [--seq-len 128] [--micro-batch 4] [--steps 20] [--activation-checkpointing] [--out times.json]
        [--device cuda --bf16]      # bench/gpu.py: NCCL, one GPU per rank, bf16 mixed precision
        [--fused]                   # fused AdamW on CPU too (fsdpjob's optimizer; always on with cuda)

What a user writes from the PyTorch FSDP2 tutorial, and nothing of fsdpjob: every rank loads the Hugging
Face folder with ``from_pretrained`` (fp32), optionally wraps each decoder layer in torch's
``checkpoint_wrapper`` (NO_REENTRANT, as jobs/model/parallelize.py does), ``fully_shard`` per decoder layer then
the root (torch's default resharding: the layers after forward, the root kept; fp32, or with ``--bf16``
bf16 parameters and fp32 gradient reduction), AdamW (betas 0.9/0.95, no weight decay, constant LR; torch's
default implementation on CPU, fused with ``--fused`` or on GPUs); a step is forward with ``labels`` (Hugging
Face's shifted mean cross-entropy), backward, ``clip_grad_norm_(1.0)``, ``optimizer.step()``, ``zero_grad``,
``loss.item()``.

The data: the JSONL's ``text`` field tokenized with the model folder's tokenizer, each line as
bos + tokens + eos, concatenated and cut into rows of ``seq_len`` (fsdpjob's ``packing: naive``), read in order
(fsdpjob with ``data.shuffle: false`` reads the same rows): step s gives rank r the rows
s*G + r*B ... s*G + r*B + B - 1 (B micro batch, G = B * world). So both see the same token ids per
step, and step 1's loss (same weights) must agree.

Rank 0 writes ``--out``: the wall-clock time after each step, the per-step loss (mean over ranks) and
tokens per step (sequences x seq_len).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path


def packed_rows(model_dir: str, data: str, seq_len: int, rows_needed: int):
    """The first ``rows_needed`` full rows of fsdpjob's naive packing of ``data`` ([rows, seq_len] int64 tensor)."""
    import torch
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    ids: list[int] = []
    with open(data, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                ids += bos + tokenizer(json.loads(line)["text"], add_special_tokens=False)["input_ids"] + eos
                if len(ids) >= rows_needed * seq_len:
                    break
    if len(ids) < rows_needed * seq_len:
        raise SystemExit(f"{data} packs into {len(ids) // seq_len} rows of {seq_len}; {rows_needed} needed")
    return torch.tensor(ids[: rows_needed * seq_len], dtype=torch.long).view(rows_needed, seq_len)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--data", required=True)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--micro-batch", type=int, default=4, help="sequences per rank per step")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--activation-checkpointing", action="store_true")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cuda: NCCL, GPU LOCAL_RANK")
    parser.add_argument("--bf16", action="store_true", help="bf16 mixed precision (fp32 master weights)")
    parser.add_argument("--fused", action="store_true",
                        help="fused AdamW on CPU too, as fsdpjob runs it (default on CPU: torch's per-tensor AdamW)")
    parser.add_argument("--out", type=Path, help="rank 0 writes step times and losses here (JSON)")
    return parser.parse_args(argv)


def build(model_dir: str, *, device: str = "cpu", activation_checkpointing: bool = False, bf16: bool = False,
          fused: bool = False, lr: float = 1e-3):
    """The model, sharded, and its optimizer, as the tutorial's user builds them (bench/step_ab.py shares this)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    model.to(device)
    layers = model.model.layers
    if activation_checkpointing:
        for i, layer in enumerate(layers):
            layers[i] = checkpoint_wrapper(layer, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
    mesh = init_device_mesh(device, (dist.get_world_size(),))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
    options = dict(mesh=mesh, **({"mp_policy": mp} if mp else {}))
    for layer in layers:
        fully_shard(layer, **options)
    fully_shard(model, **options)
    model.train()
    extra = {"fused": True} if device == "cuda" or fused else {}  # what fsdpjob uses
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0, **extra)
    return model, optimizer


def train_step(model, optimizer, batch) -> float:
    """Forward with labels, backward, clip, step; the loss read on the host, as a plain loop prints it."""
    import torch

    loss = model(input_ids=batch, labels=batch, use_cache=False).loss
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


def vmhwm_mb() -> float | None:
    """This process's peak resident memory (bench/gpu.py's host column)."""
    with open("/proc/self/status", encoding="ascii") as f:
        return next((int(line.split()[1]) / 1024 for line in f if line.startswith("VmHWM:")), None)


def _cuda_memory() -> dict[str, float]:
    """The worker's other two memory figures (jobs/report/metrics.py memory_figures), so bench/gpu.py compares like for
    like."""
    import torch

    free, total = torch.cuda.mem_get_info()
    return {"peak_reserved_mb": torch.cuda.max_memory_reserved() / 2**20, "device_used_mb": (total - free) / 2**20}


def main() -> None:
    args = parse_args()
    import torch
    import torch.distributed as dist

    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    per_step = args.micro_batch * world
    rows = packed_rows(args.model, args.data, args.seq_len, per_step * args.steps)

    model, optimizer = build(args.model, device=args.device, activation_checkpointing=args.activation_checkpointing,
                             bf16=args.bf16, fused=args.fused, lr=args.lr)
    rows = rows.to(args.device)

    times, losses = [time.time()], []
    for step in range(args.steps):
        start = step * per_step + rank * args.micro_batch
        losses.append(train_step(model, optimizer, rows[start : start + args.micro_batch]))
        times.append(time.time())

    mean = torch.tensor(losses, device=args.device)
    dist.all_reduce(mean)
    if rank == 0 and args.out:
        info = {"threads": torch.get_num_threads(), "torch": torch.__version__,
                "model_type": type(model).__name__,
                "params": sum(p.numel() for p in model.parameters()),  # DTensor: global
                "peak_mem_mb": torch.cuda.max_memory_allocated() / 2**20 if args.device == "cuda" else None,
                "vmhwm_mb": vmhwm_mb(), **(_cuda_memory() if args.device == "cuda" else {})}
        args.out.write_text(json.dumps({"times": times, "losses": (mean / world).tolist(),
                                        "tokens_per_step": per_step * args.seq_len, "info": info}))
    dist.barrier()  # no rank tears gloo down while another still talks to it
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
