"""Peak host memory per rank loading a model into FSDP2: own shards, rank-0 read + broadcast, every rank
from_pretrained.

Run: OMP_NUM_THREADS=1 python bench/load_memory.py [--ranks 2] [--layers 24] [--workdir DIR]
Builds a random Llama (about 374M parameters with the defaults) saved in fp32 and in bf16, then loads each
into fp32 FSDP2 shards with each method, each run in fresh processes, and prints a table of
VmHWM (peak resident set) above the baseline after imports and process-group setup.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MIB = 2**20
METHODS = ("own_shards", "rank0_broadcast", "every_rank_from_pretrained")  # bench/weight_load.py: times too
STORAGE = {"fp32": "float32", "bf16": "bfloat16"}


def _status_mib(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise KeyError(field)


def _worker(method: str, model_dir: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one bar per rank would bury the table

    from fsdpjob.jobs.dist import close_distributed, init_distributed
    from fsdpjob.jobs.model import NONE, find_decoder_layers, load_model
    from fsdpjob.jobs.model.parallelize import apply_fsdp, build_mesh

    torch.set_num_threads(1)
    env = init_distributed(600)
    mesh = build_mesh(env, 1)
    baseline = _status_mib("VmHWM")
    start = time.perf_counter()
    options = dict(reshard_after_forward=True, activation_checkpointing=NONE, cpu_offload=False)
    if method in ("own_shards", "rank0_broadcast"):
        os.environ["FSDPJOB_WEIGHT_LOAD"] = "sharded" if method == "own_shards" else "rank0"
        model = load_model(
            model_dir, env=env, mesh=mesh, dtype=torch.float32, attn_implementation="sdpa", mixed_precision="fp32",
            **options,
        )
    else:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        layers = find_decoder_layers(model)
        apply_fsdp(model, mesh=mesh, layers=layers, param_dtype=torch.float32, reduce_dtype=torch.float32, **options)
    torch.distributed.barrier()
    seconds = time.perf_counter() - start
    shard_bytes = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    full_params = sum(p.numel() for p in model.parameters())
    result = dict(
        rank=env.rank, baseline_mib=baseline, peak_mib=_status_mib("VmHWM"), seconds=seconds,
        shard_mib=shard_bytes / MIB, fp32_model_mib=full_params * 4 / MIB,
        anon_mib=_status_mib("RssAnon"), file_mib=_status_mib("RssFile"),
    )  # fmt: skip
    close_distributed()
    print("RESULT " + json.dumps(result), flush=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(method: str, model_dir: Path, ranks: int, script: str = __file__) -> list[dict]:
    """``script --worker METHOD MODEL_DIR`` on ``ranks`` local processes; their RESULT lines, by rank."""
    port = str(_free_port())
    procs = []
    for rank in range(ranks):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(ranks), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(ranks))
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, OMP_NUM_THREADS="1")
        argv = [sys.executable, script, "--worker", method, str(model_dir)]
        procs.append(subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, text=True))
    results = []
    for proc in procs:
        out, _ = proc.communicate(timeout=1800)
        if proc.returncode != 0:
            raise SystemExit(f"{method} on {model_dir}: a rank exited {proc.returncode}")
        results += [json.loads(line[len("RESULT ") :]) for line in out.splitlines() if line.startswith("RESULT ")]
    return sorted(results, key=lambda r: r["rank"])


def _make_models(workdir: Path, layers: int) -> dict[str, Path]:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    dirs = {name: workdir / f"llama_{layers}l_{name}" for name in STORAGE}
    if all((d / "model.safetensors").is_file() for d in dirs.values()):
        return dirs
    cfg = LlamaConfig(
        vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=layers,
        num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=2048,
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    for name, dtype in STORAGE.items():
        model.to(getattr(torch, dtype)).save_pretrained(dirs[name], max_shard_size="20GB")
    return dirs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--layers", type=int, default=24, help="decoder layers (24 gives about 374M parameters)")
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "fsdpjob_load_memory")
    parser.add_argument("--worker", nargs=2, metavar=("METHOD", "MODEL_DIR"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker(*args.worker)
        return
    dirs = _make_models(args.workdir, args.layers)
    header = (f"{'method':28} {'stored':6} {'rank':>4} {'base':>7} {'peak':>7} {'above':>7} {'shard':>7} "
              f"{'anon':>7} {'file':>7} {'s':>6}")
    print(header + "   (MiB, peaks are VmHWM)")
    summary = []
    for storage, model_dir in dirs.items():
        for method in METHODS:
            results = _run(method, model_dir, args.ranks)
            for r in results:
                above = r["peak_mib"] - r["baseline_mib"]
                print(
                    f"{method:28} {storage:6} {r['rank']:>4} {r['baseline_mib']:7.0f} {r['peak_mib']:7.0f} "
                    f"{above:7.0f} {r['shard_mib']:7.0f} {r['anon_mib']:7.0f} {r['file_mib']:7.0f} {r['seconds']:6.1f}"
                )
            others = [r for r in results if r["rank"] > 0]
            above = max(r["peak_mib"] - r["baseline_mib"] for r in others)
            overhead = max(r["peak_mib"] - r["baseline_mib"] - r["shard_mib"] for r in others)
            model_mib = results[0]["fp32_model_mib"]
            summary.append((method, storage, above / model_mib, overhead / model_mib))
    print(f"\nfp32 model: {results[0]['fp32_model_mib']:.0f} MiB; ratios are over it; "
          "overhead = peak above baseline - own shard")
    for method, storage, ratio, overhead in summary:
        print(f"{method:28} {storage:5} rank>0 peak above baseline / model = {ratio:.2f}   "
              f"overhead / model = {overhead:.2f}")


if __name__ == "__main__":
    main()
