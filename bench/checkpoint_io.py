"""Benchmark: DCP checkpoint save/load throughput against raw sequential I/O of the same bytes, and async-save blocking.

Two gloo ranks hold a FSDP2-sharded Llama (default ~374M params) plus AdamW state (~4.5 GB in all).
In the same run and on the same disk it measures, each phase between barriers (so the slower rank
counts):

* sync save (CheckpointManager.save, fsync'd) against each rank writing as many bytes as its shard
  sequentially to a new file and fsync'ing, three rounds each; ratio = raw time / DCP time (1.0: DCP
  as fast as the disk allows), of the medians and of the best rounds;
* load (CheckpointManager.load) against each rank reading its raw file, both after evicting the files
  from the page cache with posix_fadvise(DONTNEED);
* async save: time the training loop is blocked in save() over the time of a sync save.

    OMP_NUM_THREADS=1 python bench/checkpoint_io.py [--hidden 1024 --layers 24 --vocab 32000] [--dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

CHUNK = 64 << 20


def _build(world_size: int, hidden: int, layers: int, vocab: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """Sharded model with filled AdamW state; each rank only materializes its own shards."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=int(hidden * 2.75), num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 64), num_key_value_heads=max(1, hidden // 64),
    )
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().normal_(0, 0.02)
            p.grad = torch.zeros_like(p)
            p.grad.to_local().normal_(0, 1e-3)
    optimizer.step()  # materializes exp_avg / exp_avg_sq
    optimizer.zero_grad(set_to_none=True)
    return model, optimizer


def _timed(fn: Callable[[], Any]) -> float:
    """Wall time of fn on all ranks together (barrier before and after)."""
    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - start


def _raw_write(path: Path, nbytes: int, block: bytes) -> None:
    with open(path, "wb", buffering=0) as fh:
        left = nbytes
        while left > 0:
            left -= fh.write(memoryview(block)[: min(CHUNK, left)])
        os.fsync(fh.fileno())


def _raw_read(path: Path) -> None:
    buffer = bytearray(CHUNK)
    with open(path, "rb", buffering=0) as fh:
        while fh.readinto(buffer):
            pass


def _evict(paths: list[Path]) -> None:
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _rank_files(step_dir: Path, rank: int) -> list[Path]:
    own = sorted(step_dir.glob(f"__{rank}_*.distcp"))
    return own + ([step_dir / ".metadata"] if rank == 0 else [])


def _worker(rank: int, world_size: int, port: int, workdir: str, args: dict, out: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    from fsdpjob.jobs.checkpoint import CheckpointManager
    from fsdpjob.jobs.ckpt_state import ModelOptimState

    work = Path(workdir)
    model, optimizer = _build(world_size, args["hidden"], args["layers"], args["vocab"])
    state = {"model": ModelOptimState(model, optimizer)}
    params = sum(p.numel() for p in model.parameters())
    results: dict[str, Any] = {"params": params}

    sync = CheckpointManager(work / "sync", rank=rank, world_size=world_size, keep_last=3, async_save=False, sidecar={})
    block = os.urandom(CHUNK)  # incompressible, made outside the timed part
    saves: list[float] = []
    raws: list[float] = []
    own_bytes = 0

    def save(step: int) -> None:
        nonlocal own_bytes
        saves.append(_timed(lambda: sync.save(step, state, reason="bench")))
        own_bytes = sum(f.stat().st_size for f in _rank_files(sync.latest_committed(), rank))

    def write_raw() -> None:
        # A new file each time, as each checkpoint is: fresh blocks can cost more than rewritten ones.
        path = work / f"raw-{rank}-{len(raws)}.bin"
        raws.append(_timed(lambda: _raw_write(path, own_bytes, block)))

    # Round 2 writes raw first, so neither side always meets the other's leftover writeback.
    for run in (lambda: save(1), write_raw, write_raw, lambda: save(2), lambda: save(3), write_raw):
        run()
    results["save_s"], results["raw_write_s"] = saves, raws
    step_dir = sync.latest_committed()
    raw = work / f"raw-{rank}-{len(raws) - 1}.bin"
    results["bytes"] = sum(f.stat().st_size for f in step_dir.iterdir() if f.is_file())

    _evict(_rank_files(step_dir, rank) + [raw])
    results["raw_read_s"] = _timed(lambda: _raw_read(raw))
    _evict(_rank_files(step_dir, rank) + [raw])
    results["load_s"] = _timed(lambda: sync.load(step_dir, state))
    sync.close()
    for path in work.glob(f"raw-{rank}-*.bin"):
        path.unlink()
    dist.barrier()
    if rank == 0:
        shutil.rmtree(work / "sync")

    background = CheckpointManager(
        work / "async", rank=rank, world_size=world_size, keep_last=1, async_save=True, sidecar={}
    )
    results["async_blocked_s"], results["async_finish_s"] = [], []
    for step in (1, 2):  # the first one also pays for fresh staging memory
        results["async_blocked_s"].append(_timed(lambda: background.save(step, state, reason="bench")))
        results["async_finish_s"].append(_timed(background.wait))
    background.close()
    dist.destroy_process_group()
    if rank == 0:
        out.put(results)


def _report(r: dict[str, Any]) -> dict[str, Any]:
    gb = r["bytes"] / 1e9
    save, raw = statistics.median(r["save_s"]), statistics.median(r["raw_write_s"])
    return {
        "params_M": round(r["params"] / 1e6, 1),
        "checkpoint_GB": round(gb, 2),
        "save_s": [round(s, 2) for s in r["save_s"]],
        "raw_write_s": [round(s, 2) for s in r["raw_write_s"]],
        "save_GBps_median": round(gb / save, 3),
        "raw_write_GBps_median": round(gb / raw, 3),
        "save_ratio": round(raw / save, 3),
        "save_ratio_best": round(min(r["raw_write_s"]) / min(r["save_s"]), 3),
        "load_s": round(r["load_s"], 2),
        "raw_read_s": round(r["raw_read_s"], 2),
        "load_ratio": round(r["raw_read_s"] / r["load_s"], 3),
        "async_blocked_s": [round(s, 2) for s in r["async_blocked_s"]],
        "async_finish_s": [round(s, 2) for s in r["async_finish_s"]],
        "async_blocked_over_sync_save": [round(s / save, 3) for s in r["async_blocked_s"]],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--dir", type=Path, help="scratch folder on the disk to measure (default: a temp dir)")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="fsdpjob-ckpt-bench-", dir=args.dir))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    print(f"load average before: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores", flush=True)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    options = {"hidden": args.hidden, "layers": args.layers, "vocab": args.vocab}
    try:
        procs = [ctx.Process(target=_worker, args=(r, 2, port, str(workdir), options, out)) for r in range(2)]
        for p in procs:
            p.start()
        results = out.get(timeout=1200)
        for p in procs:
            p.join()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print(json.dumps(_report(results) | {"loadavg_1min_after": os.getloadavg()[0]}, indent=2))


if __name__ == "__main__":
    main()
