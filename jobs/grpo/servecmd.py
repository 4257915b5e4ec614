"""The command lines of a generation server step: this package's transformers server, or vLLM's on GPU sites.

Pure rendering (no torch, no subprocess): the supervisor puts the text in the server's srun step.

**vLLM** (rendered only: vLLM needs a CUDA GPU and is not installed where fsdpjob's tests run, so nothing here
has run it). Its OpenAI-compatible server (``vllm serve``) exposes two ways to change the served weights:

- *LoRA, from a folder* (what ``client.publish_weights`` writes): with ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``
  and ``--enable-lora --max-lora-rank R``, ``POST /v1/load_lora_adapter {"lora_name", "lora_path",
  "load_inplace": true}`` loads a peft adapter folder, replacing the adapter of that name in place; completions
  then name the adapter as their ``model`` (vLLM's ``vllm/entrypoints/serve/lora/api_router.py`` and
  ``LoadLoRAAdapterRequest``; docs.vllm.ai "LoRA Adapters", "Dynamically serving LoRA Adapters").
  ``vllm_lora_load`` renders that request.
- *Full weights, over NCCL* (no files): TRL's ``trl vllm-serve`` is, since TRL 1.x, a thin wrapper that execs
  ``vllm serve ... --weight-transfer-config '{"backend": "nccl"}'`` with ``VLLM_SERVER_DEV_MODE=1``
  (``trl/scripts/vllm_serve.py``, ``build_command``); the trainer joins an NCCL group through
  ``POST /init_weight_transfer_engine`` and streams the tensors between ``/start_weight_update``,
  ``/update_weights`` and ``/finish_weight_update`` (vLLM's ``vllm/entrypoints/serve/dev/rlhf/api_router.py``;
  TRL's ``VLLMClient.init_communicator`` / ``update_named_params``). This package's ``GenerationClient`` loads
  from files and does not speak that protocol: full-weight GRPO on vLLM needs TRL's client on the trainer side.

Per-request ``seed`` makes vLLM's sampling reproducible; ``VLLM_BATCH_INVARIANT=1`` (beta, recent GPUs) makes
a request's result independent of what else is batched with it (docs.vllm.ai "Batch Invariance"). vLLM's
completions are not bitwise those of the transformers server: a run keeps one backend from start to resume.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path


def server_argv(model: str | Path, *, host: str, port: int, dtype: str = "float32", device: str | None = None,
                ready_file: str | Path | None = None, threads: int | None = None,
                python: str = "python") -> list[str]:
    """``python -m fsdpjob.jobs.grpo.server ...``: this package's server (``threads``: pin torch's CPU threads,
    so that a restarted server samples bitwise as the one before)."""
    argv = [python, "-m", "fsdpjob.jobs.grpo.server", "--model", str(model), "--host", host, "--port", str(port),
            "--dtype", dtype]
    if device is not None:
        argv += ["--device", device]
    if ready_file is not None:
        argv += ["--ready-file", str(ready_file)]
    if threads is not None:
        argv += ["--threads", str(threads)]
    return argv


def vllm_serve_command(model: str | Path, *, host: str, port: int, dtype: str = "bfloat16", seed: int = 0,
                       lora_rank: int | None = None, tensor_parallel_size: int = 1,
                       gpu_memory_utilization: float = 0.9, max_model_len: int | None = None,
                       batch_invariant: bool = True) -> str:
    """The shell line that starts vLLM's server for GRPO: LoRA adapters loadable from folders when ``lora_rank``
    is given (the most rank an adapter may have), else the NCCL weight-transfer engine for full weights."""
    env = {"VLLM_SERVER_DEV_MODE": "1"}  # the weight-transfer and pause routes live behind vLLM's dev mode
    if batch_invariant:
        env["VLLM_BATCH_INVARIANT"] = "1"
    argv = ["vllm", "serve", str(model), "--host", host, "--port", str(port), "--dtype", dtype,
            "--seed", str(seed), "--tensor-parallel-size", str(tensor_parallel_size),
            "--gpu-memory-utilization", str(gpu_memory_utilization)]
    if max_model_len is not None:
        argv += ["--max-model-len", str(max_model_len)]
    if lora_rank is not None:
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
        argv += ["--enable-lora", "--max-lora-rank", str(lora_rank), "--max-loras", "1"]
    else:
        argv += ["--weight-transfer-config", json.dumps({"backend": "nccl"})]
    return shlex.join([f"{k}={v}" for k, v in sorted(env.items())] + argv)


def vllm_lora_load(folder: str | Path, name: str = "policy") -> tuple[str, dict]:
    """The route and body that make a vLLM server (started with ``lora_rank``) serve the adapter in ``folder``
    under ``name``, replacing the one loaded before it under that name."""
    return "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(folder), "load_inplace": True}
