"""Generation on vLLM (``generator: {backend: vllm}``): the supervisor started the server for this launch
(orchestrator/supervise/genserver.py) and passes its address in FSDPJOB_GENERATION_SERVER; the protocol is
orchestrator/core/genserver/vllm.py's.

Before a round whose policy the server does not serve yet, the ranks gather the policy and rank 0 publishes it: full
weights as a folder ``vN/model.safetensors`` (the older one removed) that the server reloads in place; with LoRA the
adapters only, as a peft folder loaded in place. A server is started with each launch, so a new launch (a restart
after a fault, a requeue) loads the policy of its first round again. Each prompt's group is one request of
``num_generations`` choices with a seed of its own drawn from the rank's round generator (seeded by the run's seed,
the round's first step and the rank): a resumed round asks for what the interrupted one did, and gets it, bit for bit
(vLLM's CPU path is deterministic for a fixed request and weights). The sampler's log-probabilities come back with
each completion (truncated importance sampling, step.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from fsdpjob.orchestrator.core.genserver.client import publish_weights
from fsdpjob.orchestrator.core.genserver.vllm import LORA_NAME, SEED_LIMIT, VllmClient, group_seeds, publish_full

from ..dist import DistEnv, host_barrier
from ..model.lora import is_adapter_key, lora_config
from .remote import RemoteGeneration


@dataclass
class SampledCompletions:
    completion_ids: torch.Tensor  # [N, T] padded after the end
    mask: torch.Tensor  # [N, T] the completion's tokens
    logps: torch.Tensor  # [N, T] float32: the sampler's log-probability of each token (0 outside the mask)


class VllmGeneration(RemoteGeneration):
    """The rounds' ``generate`` and ``before_round`` over a vLLM server."""

    def __init__(self, spec, model: torch.nn.Module, env: DistEnv, run_dir: Path, pad_id: int,
                 control: dist.ProcessGroup | None):
        super().__init__(spec, model, env, run_dir, pad_id, control)
        self.client = VllmClient(f"http://{self.address}", spec.grpo.generator.deadline_s, spec.model.path)
        self.serving = 0  # the policy version the server serves: its own weights at start (LoRA's B is 0: the base)

    def before_round(self, start_step: int) -> None:
        """The policy of step ``start_step`` on the server (every rank: the gather is a collective)."""
        if start_step == self.serving:
            return
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if self.env.is_main:
            if self.lora is not None:
                adapters = {k: v for k, v in state.items() if is_adapter_key(k)}
                path = publish_weights(adapters, self.folder, start_step, lora_config=lora_config(self.lora).to_dict(),
                                       keep=1)
                self.client.load_lora(path)
            else:
                self.client.reload_weights(publish_full(state, self.folder, start_step))
        host_barrier(self.control)
        if self.lora is not None:
            self.client.served = LORA_NAME  # every rank's client asks for the adapter from now on
        self.serving = start_step

    def generate(self, prompt_ids: list[list[int]], generator: torch.Generator) -> SampledCompletions:
        return generate_groups(self.client, self.options, prompt_ids, generator, self.pad_id)


def generate_groups(engine, options, prompt_ids: list[list[int]], generator: torch.Generator,
                    pad_id: int) -> SampledCompletions:
    """The completions of ``prompt_ids`` (groups of ``num_generations`` equal prompts, consecutive: rounds.py) from
    a vLLM ``engine``: the server's client (VllmClient) or the colocated engine (colocate.py), which take the same
    request. One request per group with n = num_generations and a seed of its own (``group_seeds``), from a base
    drawn from the rank's round generator: the same prompts and round give the same request on either engine."""
    n = options.num_generations
    unique = prompt_ids[::n]
    if [p for p in unique for _ in range(n)] != prompt_ids:
        raise ValueError("vLLM generation expects each prompt repeated num_generations times, consecutively")
    base = int(torch.randint(0, SEED_LIMIT, (1,), generator=generator, device=generator.device))
    sampled = engine.generate(unique, n=n, seeds=group_seeds(base, len(unique), n), max_tokens=options.max_new_tokens,
                              temperature=options.temperature, top_p=options.top_p)
    width = options.max_new_tokens
    out = torch.full((len(sampled), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sampled), width), dtype=torch.bool)
    logps = torch.zeros((len(sampled), width), dtype=torch.float32)
    for i, c in enumerate(sampled):
        k = min(len(c.token_ids), width)
        out[i, :k] = torch.tensor(c.token_ids[:k], dtype=torch.long)
        mask[i, :k] = True
        logps[i, :k] = torch.tensor(c.logprobs[:k], dtype=torch.float32)
    return SampledCompletions(out, mask, logps)
