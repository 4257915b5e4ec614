"""Run a function on N real gloo ranks in new processes (tests only)."""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import traceback
from collections.abc import Callable
from multiprocessing import forkserver
from typing import Any


def free_port() -> int:
    """A port free now, below Linux's ephemeral range: the product's own draw (core/rendezvous.pick_port). A port
    the kernel hands out for a bind to port 0 lies in that range, where any outgoing connection on the host may take
    it between this check and rank 0's bind (the EADDRINUSE window the product left, f8737cb)."""
    from fsdpjob.orchestrator.core.rendezvous import pick_port

    return pick_port()


# The ranks fork from one server process that has imported torch and the worker once (per pytest process): a
# spawned rank imported them itself at every launch, 10-50 s a launch on CI's two loaded cores. Each rank is
# still a new process that holds nothing of an earlier run; it takes the launching process's environment of the
# moment (the server's is that of its own start), as a spawned one would.
# What every forked rank would import again (~1.8 CPU-s each, ~240 ranks a suite): the worker, transformers' model
# and tokenizer paths (the worker imports them when it builds the model) and peft (the LoRA tests').
PRELOAD = ["torch", "fsdpjob.jobs.train", "transformers.models.llama.modeling_llama",
           "transformers.models.auto.tokenization_auto", "peft"]
M_MMAP_THRESHOLD = -3  # mallopt's parameter number (malloc.h)


def _context(fresh: bool = False) -> Any:
    if fresh:
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # takes effect when the server starts
    # The server starts with the stock malloc whatever the launch that starts it asks its ranks for: glibc reads
    # MALLOC_* at process start and forked ranks inherit the server's (a bench that fixed the mmap threshold for
    # its ranks once left it fixed for every later test's ranks, whose peaks then read 25 % low).
    asked = {name: os.environ.pop(name) for name in list(os.environ) if name.startswith("MALLOC_")}
    try:
        forkserver.ensure_running()
    finally:
        os.environ.update(asked)
    return ctx


def _child(fn: Callable, rank: int, world_size: int, port: int, kwargs: dict, queue: Any, environ: dict) -> None:
    os.environ.clear()
    os.environ.update(environ)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        OMP_NUM_THREADS="1",
    )
    threshold = environ.get("MALLOC_MMAP_THRESHOLD_")
    if threshold:  # glibc reads it at process start: a forked rank has the server's malloc, so set it as it would
        ctypes.CDLL(None).mallopt(M_MMAP_THRESHOLD, int(threshold))  # fixed: no dynamic threshold, as the variable
    try:
        import torch

        torch.set_num_threads(1)
        result = fn(rank, world_size, **kwargs)
        queue.put((rank, "ok", result))
    except BaseException:  # report everything to the parent
        queue.put((rank, "error", traceback.format_exc()))


def _spawn(fn: Callable, world_size: int, kwargs: dict, fresh: bool = False) -> tuple[list, Any]:
    """Start ``world_size`` ranks of ``fn`` on one free port; (processes, the queue they report to)."""
    ctx = _context(fresh)
    queue = ctx.Queue()
    port = free_port()
    environ = dict(os.environ)
    procs = [ctx.Process(target=_child, args=(fn, r, world_size, port, kwargs, queue, environ))
             for r in range(world_size)]
    for p in procs:
        p.start()
    return procs, queue


def run_ranks(fn: Callable, world_size: int, timeout: float = 300, *, fresh_interpreter: bool = False,
              **kwargs: Any) -> list[Any]:
    """Call ``fn(rank, world_size, **kwargs)`` on ``world_size`` new processes; return results by rank.

    ``fn`` must be importable (a module-level function). The environment carries MASTER_ADDR/PORT,
    RANK and WORLD_SIZE, as the product's launchers set them; ``fn`` creates its own process group.
    ``fresh_interpreter``: spawned ranks that import everything themselves (a test of what happens during the
    worker's imports), not forked from the server that imported torch and the worker already.
    """
    procs, queue = _spawn(fn, world_size, kwargs, fresh_interpreter)
    results: dict[int, Any] = {}
    errors = []
    try:
        for _ in range(world_size):
            rank, status, value = queue.get(timeout=timeout)
            if status == "ok":
                results[rank] = value
            else:
                errors.append(f"rank {rank}:\n{value}")
                break
    finally:
        for p in procs:
            p.join(timeout=5 if not errors else 1)
            if p.is_alive():
                p.kill()
    if errors:
        raise AssertionError("\n".join(errors))
    return [results[r] for r in range(world_size)]


def committed_model_state(run_dir) -> dict:
    """Model tensors of a run's newest committed checkpoint, read in this process (no process group)."""
    from pathlib import Path

    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    ckpt = Path(run_dir) / "checkpoints"
    step_dir = ckpt / (ckpt / "latest").read_text().strip()
    out = Path(run_dir) / f"{step_dir.name}.pt"
    dcp_to_torch_save(str(step_dir), str(out))
    state = torch.load(out, weights_only=False)
    out.unlink()
    return dict(state["model"]["model"])


def write_run(root, name: str, spec: dict, *, defer_grad_sync: bool = True, facts: dict | None = None,
              resume_from: str | None = None):
    """A run folder as `fsdpjob submit` writes it for the workers: the validated spec (and the plan's verdict on
    deferring the gradient reduce-scatter, with any other ``facts`` of the plan) in spec.json, and its
    ``--resume-from``. Returns the folder."""
    from fsdpjob.orchestrator.core.jobspec.spec import JobSpec
    from fsdpjob.orchestrator.core.runfolder.paths import RunPaths
    from fsdpjob.orchestrator.core.runfolder.runmeta import RunMeta

    run_dir = root / name
    run_dir.mkdir()
    spec = JobSpec.model_validate({"name": name, **spec})
    RunMeta.of(spec, worker_facts={"defer_grad_sync": defer_grad_sync, **(facts or {})},
               resume_from=resume_from).write(RunPaths(run_dir))
    return run_dir


def logged_losses(run_dir) -> dict[int, float]:
    """Step -> loss from a run's metrics.jsonl."""
    import json
    from pathlib import Path

    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return {m["step"]: m["loss"] for m in map(json.loads, lines) if "loss" in m}


def train_worker(rank: int, world_size: int, run_dir: str, env: dict) -> int:
    """One rank of jobs.train.run on ``run_dir`` (for run_ranks): 0, or the exit code of a stop (SystemExit)."""
    os.environ.update(env)
    from fsdpjob.jobs.train import run

    try:
        run(run_dir)
    except SystemExit as exc:  # the stop path leaves without a result, as under Slurm
        return int(exc.code or 0)
    return 0


def node_worker(rank: int, world_size: int, run_dir: str, env: dict, nodes: list[str],
                log_file: str | None = None) -> int:
    """train_worker on the emulated node ``nodes[rank]`` (SLURMD_NODENAME, as Slurm sets it on each node);
    ``log_file``: the worker's log lines appended there too."""
    if log_file:
        import logging

        logging.getLogger("fsdpjob").addHandler(logging.FileHandler(log_file))
    return train_worker(rank, world_size, run_dir, {**env, "SLURMD_NODENAME": nodes[rank]})


def exit_codes(fn: Callable, world_size: int, timeout: float = 300, **kwargs: Any) -> list[int | None]:
    """Like run_ranks, for ranks that leave by os._exit (a crash): their exit codes, by rank."""
    procs, _ = _spawn(fn, world_size, kwargs)
    for p in procs:
        p.join(timeout=timeout)
        if p.is_alive():
            p.kill()
            p.join()
    return [p.exitcode for p in procs]


def trained_logits(rank: int, world_size: int, run_dir: str, input_ids, check: Callable | None = None) -> object:
    """One rank of the trained LoRA model's logits (for run_ranks): built as the worker builds it (a 4-bit base
    with model.quantize), its newest committed adapters loaded; ``check(model)`` must hold before the forward."""
    import json
    from pathlib import Path

    import torch

    from fsdpjob.jobs.checkpoint import CheckpointManager
    from fsdpjob.jobs.checkpoint.state import ModelOptimState
    from fsdpjob.jobs.dist import close_distributed, init_distributed
    from fsdpjob.jobs.model import NONE, load_model
    from fsdpjob.jobs.model.lora import trainable_parameters
    from fsdpjob.jobs.model.parallelize import build_mesh
    from fsdpjob.orchestrator.core.jobspec.spec import JobSpec

    spec = JobSpec.model_validate(json.loads((Path(run_dir) / "spec.json").read_text())["spec"])
    env = init_distributed(120)
    try:
        model = load_model(spec.model.path, env=env, mesh=build_mesh(env, 1), dtype=torch.float32,
                           attn_implementation="sdpa", mixed_precision="fp32", reshard_after_forward=True,
                           activation_checkpointing=NONE, cpu_offload=False, lora=spec.model.lora,
                           quantize=spec.model.quantize)
        assert check is None or check(model), "the model built for the logits is not the one trained"
        optimizer = torch.optim.AdamW(trainable_parameters(model))
        root = Path(run_dir) / "checkpoints"
        ckpt = CheckpointManager(root, rank=rank, world_size=world_size, keep_last=2, async_save=False, sidecar={})
        ckpt.load(root / (root / "latest").read_text().strip(),
                  {"model": ModelOptimState(model, optimizer, trainable_only=True)})
        ckpt.close()
        model.eval()
        with torch.no_grad():
            return model(input_ids=input_ids).logits.numpy()  # by value: a tensor would be shared memory
    finally:
        close_distributed()


def uninterrupted_and_resumed(make: Callable[[str], Any], train: Callable[..., list[int]],
                              stop_at: int) -> dict[str, Any]:
    """Two runs of one spec (``make(name)`` writes a run folder): "full" trained through, "stopped" stopped at step
    ``stop_at`` (FSDPJOB_STOP_AT_STEP) and resumed by a second launch; ``train(run_dir, **env)`` returns the exit
    codes by rank, all 0."""
    full = make("full")
    assert set(train(full)) == {0}
    stopped = make("stopped")
    assert set(train(stopped, FSDPJOB_STOP_AT_STEP=str(stop_at))) == {0}
    assert set(train(stopped)) == {0}
    return {"full": full, "stopped": stopped}
