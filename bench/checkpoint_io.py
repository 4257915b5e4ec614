"""Benchmark: DCP checkpoint save/load throughput against raw sequential I/O of the same bytes, and async-save blocking.

Two gloo ranks hold a FSDP2-sharded Llama (default ~374M params) plus AdamW state (~4.5 GB in all).
In the same run and on the same disk it measures, each phase between barriers (so the slower rank
counts):

* sync save (CheckpointManager.save, fsync'd) against each rank writing as many bytes as its shard
  sequentially to a new file and fsync'ing, --rounds each in rotating order; ratio = raw time / DCP time
  (1.0: DCP as fast as the disk allows), of the medians and of the best rounds;
* load (CheckpointManager.load) against each rank reading its raw file, both after evicting the files
  from the page cache with posix_fadvise(DONTNEED), --rounds each, alternating;
* async save: time the training loop is blocked over the median time of a sync save, three saves (the first
  one allocates the staging memory): the time in save() plus what the next step's optimizer step waits for the
  background copy, after a forward and backward of --step-tokens tokens (reported beside it).

With --compare-stock the same run also measures DCP's stock FileSystemWriter/Reader behaviour
(FSDPJOB_CHECKPOINT_IO=stock: the same files, CRC32 and no early write-back on save, torch.load and a copy per
tensor on load), interleaved with the worker's own (jobs/checkpoint/io.py): before and after on the same disk.

    OMP_NUM_THREADS=1 python bench/checkpoint_io.py [--hidden 1024 --layers 24 --vocab 32000] [--dir DIR]
        [--rounds 3] [--compare-stock]
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
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from common import evict_from_page_cache  # bench/common.py (this folder is on sys.path)

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


def _forward_backward(model: torch.nn.Module, vocab: int, tokens: int) -> None:
    ids = torch.randint(0, vocab, (1, tokens), generator=torch.Generator().manual_seed(tokens))
    model(input_ids=ids, labels=ids).loss.backward()


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


def _rank_files(step_dir: Path, rank: int) -> list[Path]:
    own = sorted(step_dir.glob(f"__{rank}_*.distcp"))
    return own + ([step_dir / ".metadata"] if rank == 0 else [])


def _keep_newest(root: Path, rank: int) -> None:
    """Drop all but the newest step folder, outside the timed part (a real save's purge is not disk write speed)."""
    if rank == 0:
        for step_dir in sorted(root.glob("step-*"))[:-1]:
            shutil.rmtree(step_dir)
    dist.barrier()


def _worker(rank: int, world_size: int, port: int, workdir: str, args: dict, out: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    from fsdpjob.jobs.checkpoint import CheckpointManager
    from fsdpjob.jobs.checkpoint import io as ckpt_io
    from fsdpjob.jobs.checkpoint.state import ModelOptimState

    def use(mode: str) -> None:  # "fast": the worker's writer and reader; "stock": DCP's own, same files
        os.environ[ckpt_io.SWITCH] = mode

    work = Path(workdir)
    model, optimizer = _build(world_size, args["hidden"], args["layers"], args["vocab"])
    state = {"model": ModelOptimState(model, optimizer)}
    params = sum(p.numel() for p in model.parameters())
    modes = args["modes"]
    results: dict[str, Any] = {"params": params, "modes": modes, "loadavg": [os.getloadavg()[0]]}

    sync = CheckpointManager(work / "sync", rank=rank, world_size=world_size, keep_last=1000, async_save=False,
                             sidecar={})  # fmt: skip
    block = os.urandom(CHUNK)  # incompressible, made outside the timed part
    saves: dict[str, list[float]] = {m: [] for m in modes}
    raws: list[float] = []
    own = {"bytes": 0, "step": 0}

    def save(mode: str) -> None:
        use(mode)
        own["step"] += 1
        saves[mode].append(_timed(lambda: sync.save(own["step"], state, reason="bench")))
        own["bytes"] = sum(f.stat().st_size for f in _rank_files(sync.latest_committed(), rank))
        _keep_newest(work / "sync", rank)

    def write_raw() -> None:
        # A new file each time, as each checkpoint is: fresh blocks can cost more than rewritten ones.
        path = work / f"raw-{rank}.bin"
        raws.append(_timed(lambda: _raw_write(path, own["bytes"], block)))
        path.unlink()
        dist.barrier()

    # Rounds rotate the order, so neither side always meets the other's leftover write-back.
    save(modes[0])  # sizes the raw write; not counted
    saves[modes[0]].clear()
    order = [write_raw, *(lambda m=m: save(m) for m in modes)]
    for round_ in range(args["rounds"]):
        for run in order[round_ % len(order):] + order[: round_ % len(order)]:
            run()
    results["save_s"], results["raw_write_s"] = saves, raws
    step_dir = sync.latest_committed()
    raw = work / f"raw-{rank}.bin"
    _raw_write(raw, own["bytes"], block)
    results["bytes"] = sum(f.stat().st_size for f in step_dir.iterdir() if f.is_file())

    loads: dict[str, list[float]] = {m: [] for m in modes}
    raw_reads: list[float] = []
    for round_ in range(args["rounds"]):
        for mode in (["raw", *modes] if round_ % 2 == 0 else [*modes, "raw"]):
            evict_from_page_cache(_rank_files(step_dir, rank) + [raw])
            if mode == "raw":
                raw_reads.append(_timed(lambda: _raw_read(raw)))
            else:
                use(mode)
                loads[mode].append(_timed(lambda: sync.load(step_dir, state)))
    results["load_s"], results["raw_read_s"] = loads, raw_reads
    sync.close()
    raw.unlink()
    dist.barrier()
    if rank == 0:
        shutil.rmtree(work / "sync")

    results["async_blocked_s"], results["async_finish_s"] = {}, {}
    for mode in modes:
        use(mode)
        background = CheckpointManager(
            work / f"async-{mode}", rank=rank, world_size=world_size, keep_last=1, async_save=True, sidecar={}
        )
        blocked, finish, computed = [], [], []
        for step in (1, 2, 3):  # the first one also pays for fresh staging memory
            in_save = _timed(lambda: background.save(step, state, reason="bench"))  # noqa: B023 - called at once
            # The next training step: its forward and backward overlap the background copy, and its optimizer
            # step waits for what is left of it (jobs/checkpoint/staging.py); the loop is blocked for both parts.
            computed.append(_timed(lambda: _forward_backward(model, args["vocab"], args["step_tokens"])))
            _timed(optimizer.step)
            at_step = torch.tensor([background._gate.waited_s if background._gate else 0.0])
            dist.all_reduce(at_step, op=dist.ReduceOp.MAX)
            blocked.append(in_save + float(at_step))
            optimizer.zero_grad(set_to_none=True)
            finish.append(_timed(background.wait))
        background.close()
        results["async_blocked_s"][mode], results["async_finish_s"][mode] = blocked, finish
        results.setdefault("async_step_compute_s", {})[mode] = computed
        dist.barrier()
        if rank == 0:
            shutil.rmtree(work / f"async-{mode}")
    results["loadavg"].append(os.getloadavg()[0])
    dist.destroy_process_group()
    if rank == 0:
        out.put(results)


def _rounded(values: list[float]) -> list[float]:
    return [round(v, 2) for v in values]


def _report(r: dict[str, Any]) -> dict[str, Any]:
    gb = r["bytes"] / 1e9
    raw_w, raw_r = statistics.median(r["raw_write_s"]), statistics.median(r["raw_read_s"])
    report: dict[str, Any] = {
        "params_M": round(r["params"] / 1e6, 1),
        "checkpoint_GB": round(gb, 2),
        "raw_write_s": _rounded(r["raw_write_s"]),
        "raw_write_GBps_median": round(gb / raw_w, 3),
        "raw_read_s": _rounded(r["raw_read_s"]),
        "loadavg_1min_start_end": [round(x, 1) for x in r["loadavg"]],
    }
    for mode in r["modes"]:
        save, load = statistics.median(r["save_s"][mode]), statistics.median(r["load_s"][mode])
        blocked = r["async_blocked_s"][mode]
        report[mode] = {
            "save_s": _rounded(r["save_s"][mode]),
            "save_GBps_median": round(gb / save, 3),
            "save_ratio": round(raw_w / save, 3),
            "save_ratio_best": round(min(r["raw_write_s"]) / min(r["save_s"][mode]), 3),
            "load_s": _rounded(r["load_s"][mode]),
            "load_ratio": round(raw_r / load, 3),
            "load_ratio_best": round(min(r["raw_read_s"]) / min(r["load_s"][mode]), 3),
            "async_blocked_s": _rounded(blocked),
            "async_finish_s": _rounded(r["async_finish_s"][mode]),
            "async_blocked_over_sync_save": [round(b / save, 3) for b in blocked],
            "async_overlapped_step_compute_s": _rounded(r["async_step_compute_s"][mode]),
        }
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--dir", type=Path, help="scratch folder on the disk to measure (default: a temp dir)")
    parser.add_argument("--rounds", type=int, default=3, help="timed saves, loads and raw transfers each")
    parser.add_argument("--step-tokens", type=int, default=256,
                        help="tokens of the training step (forward + backward) run after each async save")
    parser.add_argument("--compare-stock", action="store_true",
                        help="also measure DCP's stock writer and reader (FSDPJOB_CHECKPOINT_IO=stock) in the same run")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="fsdpjob-ckpt-bench-", dir=args.dir))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    print(f"load average before: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores", flush=True)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    modes = ["fast", "stock"] if args.compare_stock else ["fast"]
    options = {"hidden": args.hidden, "layers": args.layers, "vocab": args.vocab, "rounds": args.rounds, "modes": modes,
               "step_tokens": args.step_tokens}
    try:
        procs = [ctx.Process(target=_worker, args=(r, 2, port, str(workdir), options, out)) for r in range(2)]
        for p in procs:
            p.start()
        results = out.get(timeout=3600)
        for p in procs:
            p.join()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print(json.dumps(_report(results), indent=2))


if __name__ == "__main__":
    main()
