"""What several benchmarks share: random text and tiny Llama assets, the run folder the worker reads, and
local rank processes (worker_throughput.py, memory_scaling.py, resume_latency.py, step_ab.py)."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))  # free_port

from distributed import free_port  # noqa: E402


@dataclass(frozen=True)
class ModelSize:
    vocab: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int


def random_text(lines: int, seed: int = 0) -> list[str]:
    """Lines of made-up words with Zipf-like frequencies: enough distinct merges for a BPE of a few thousand tokens."""
    rng = random.Random(seed)
    syllables = [c + v for c in "bcdfghjklmnprstvwz" for v in "aeiou"]
    lexicon = ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 4))) for _ in range(30000)]
    cumulative, total = [], 0.0
    for i in range(len(lexicon)):
        total += 1.0 / (i + 1)
        cumulative.append(total)
    return [" ".join(rng.choices(lexicon, cum_weights=cumulative, k=rng.randint(40, 120))) for _ in range(lines)]


def make_assets(root: Path, size: ModelSize, *, lines: int = 3000, max_positions: int = 512) -> tuple[Path, Path]:
    """A BPE tokenizer and a random Llama of ``size`` in root/model, text lines in root/data.jsonl."""
    from transformers.utils import logging as hf_logging

    from fsdpjob.jobs.quickstart import build_tiny_model, build_tokenizer

    hf_logging.disable_progress_bar()

    texts = random_text(lines)
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    model = root / "model"
    tokenizer = build_tokenizer(model, texts, vocab_size=size.vocab)
    if len(tokenizer) != size.vocab:
        raise RuntimeError(f"the tokenizer has {len(tokenizer)} tokens, not {size.vocab}: give random_text more lines")
    build_tiny_model(
        model, hidden_size=size.hidden, intermediate_size=size.intermediate, num_layers=size.layers,
        num_heads=size.heads, num_kv_heads=size.kv_heads, max_position_embeddings=max_positions,
    )  # fmt: skip
    return model, data


def job_spec(
    name: str, model: Path, data: Path, *, seq_len: int, micro_batch: int, max_steps: int, **sections: dict
) -> dict:
    """A JobSpec dict: packed text, constant LR (so any step costs the same), time-based saves off."""
    spec: dict[str, Any] = {
        "name": name,
        "model": {"path": str(model)},
        "data": {"path": str(data), "seq_len": seq_len, "packing": "naive"},  # the rows bare_fsdp2.py reads
        "train": {"max_steps": max_steps, "micro_batch_size": micro_batch, "lr": 1e-3, "lr_schedule": "constant",
                  "log_every": 1},
        "checkpoint": {"interval_minutes": 0},
    }  # fmt: skip
    for section, values in sections.items():
        spec.setdefault(section, {}).update(values)
    return spec


def write_run_folder(run_dir: Path, spec: dict, resume_from: str | None = None) -> Path:
    """The run folder the worker reads (spec.json, through RunMeta as `fsdpjob submit` writes it)."""
    from fsdpjob.orchestrator.core.jobspec.spec import JobSpec
    from fsdpjob.orchestrator.core.runfolder.paths import RunPaths
    from fsdpjob.orchestrator.core.runfolder.runmeta import RunMeta

    run_dir.mkdir(parents=True)
    RunMeta.of(JobSpec.model_validate(spec), resume_from=resume_from).write(RunPaths(run_dir))
    return run_dir


def launch_ranks(argv: list[str], world: int, log_dir: Path, *, timeout: float = 900, env: dict | None = None) -> float:
    """Run ``python argv`` on ``world`` local ranks; return the wall time from just before the first spawn.

    Each rank's output goes to log_dir/rank<r>.log; a failing rank raises with the end of its log.
    """
    port = str(free_port())
    log_dir.mkdir(parents=True, exist_ok=True)
    started = time.time()
    procs = []
    for rank in range(world):
        rank_env = dict(os.environ, **(env or {}), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                        LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=port, OMP_NUM_THREADS="1")
        log = open(log_dir / f"rank{rank}.log", "w", encoding="utf-8")  # closed after wait
        proc = subprocess.Popen([sys.executable, *argv], env=rank_env, stdout=log, stderr=subprocess.STDOUT)
        procs.append((proc, log))
    try:
        for rank, (proc, log) in enumerate(procs):
            rc = proc.wait(timeout=max(1.0, started + timeout - time.time()))
            log.close()
            if rc != 0:
                tail = (log_dir / f"rank{rank}.log").read_text(encoding="utf-8")[-3000:]
                raise RuntimeError(f"rank {rank} of {' '.join(argv)} exited {rc}; end of its log:\n{tail}")
    finally:
        for proc, log in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()
    return time.time() - started


def evict_from_page_cache(paths: Iterable[Path]) -> int:
    """Write each file's dirty pages back and drop all its pages from the page cache (posix_fadvise DONTNEED leaves
    dirty pages), so the next read comes from the disk; returns the bytes dropped."""
    dropped = 0
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            dropped += os.fstat(fd).st_size
        finally:
            os.close(fd)
    return dropped


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def proc_status_mib(field: str) -> float:
    """A kB field of /proc/self/status (VmRSS, VmHWM, ...) in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise KeyError(field)


def peak_during(field: str, fn: Callable[[], Any]) -> float:
    """The largest rise (MiB) of a /proc/self/status field sampled every millisecond while ``fn()`` runs (for a
    field with no high-water mark of its own: RssAnon, the process's own memory without mapped files)."""
    start, peak, done = proc_status_mib(field), [0.0], threading.Event()

    def sample() -> None:
        while not done.wait(0.001):
            peak.append(proc_status_mib(field) - start)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        fn()
    finally:
        done.set()
        sampler.join()
    return max(peak)


def load_note() -> str:
    return f"load average (1 min) {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs"
