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

A server that gives no answer within grpo.generator.deadline_s (frozen, killed) is reported lost
(core/genserver/handover.py); the rank waits for the supervisor's replacement, which serves the policy rank 0 last
loaded, and asks again with the same seeds: the round in flight is regenerated, bit for bit, and no rank leaves the
training step. The other ranks never notice unless their own requests fail: a rank that finished its requests waits
in the round's gather, the others in the barrier after rank 0's weight load. Those two collectives run on a gloo
group of their own (``wait_group``) whose timeout covers a detection and a replacement (a vLLM start takes minutes:
more than fsdp.collective_timeout_s may allow); the supervisor bounds the replacement and ends the step if it fails.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch
import torch.distributed as dist

from fsdpjob.orchestrator.core import envvars
from fsdpjob.orchestrator.core.genserver import handover
from fsdpjob.orchestrator.core.genserver.client import ServerUnresponsive, publish_weights
from fsdpjob.orchestrator.core.genserver.vllm import LORA_NAME, SEED_LIMIT, VllmClient, group_seeds, publish_full

from ..dist import DistEnv, export_group, host_barrier
from ..model.lora import is_adapter_key, lora_config

T = TypeVar("T")
POLL_S = 0.5
# How long a rank waits for a replacement server at most: the supervisor bounds the replacement itself (its launch
# bound) and ends the step when it fails; this only keeps a rank from waiting forever on a supervisor gone.
REPLACEMENT_BOUND_S = 3600.0


@dataclass
class SampledCompletions:
    completion_ids: torch.Tensor  # [N, T] padded after the end
    mask: torch.Tensor  # [N, T] the completion's tokens
    logps: torch.Tensor  # [N, T] float32: the sampler's log-probability of each token (0 outside the mask)


class VllmGeneration:
    """The rounds' ``generate`` and ``before_round`` over a vLLM server."""

    def __init__(self, spec, model: torch.nn.Module, env: DistEnv, run_dir: Path, pad_id: int,
                 control: dist.ProcessGroup | None):
        address = envvars.get("FSDPJOB_GENERATION_SERVER")
        if not address:
            raise RuntimeError("grpo.generator.backend is vllm but no generation server was started for this launch "
                               "(FSDPJOB_GENERATION_SERVER unset): run it through fsdpjob submit")
        self.options, self.model, self.env, self.pad_id, self.control = spec.grpo, model, env, pad_id, control
        self.lora, self.run_dir = spec.model.lora, run_dir
        self.folder = handover.folder(run_dir) / "weights"
        self.deadline_s = spec.grpo.generator.deadline_s
        self.client = VllmClient(f"http://{address}", self.deadline_s, spec.model.path)
        served = handover.read_address(run_dir)
        self.start = served.start if served is not None and served.address == address else 0
        self.serving = 0  # the policy version the server serves: its own weights at start (LoRA's B is 0: the base)
        # The waits that may outlast a server's replacement (module docstring); every rank builds it (a collective).
        wait_s = int(REPLACEMENT_BOUND_S + 3 * self.deadline_s)
        self.wait_group = export_group(wait_s) if env.world_size > 1 and dist.is_initialized() else control

    def before_round(self, start_step: int) -> None:
        """The policy of step ``start_step`` on the server (every rank: the gather is a collective)."""
        self._follow()
        if start_step == self.serving:
            return
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if self.env.is_main:
            if self.lora is not None:
                adapters = {k: v for k, v in state.items() if is_adapter_key(k)}
                path = publish_weights(adapters, self.folder, start_step, lora_config=lora_config(self.lora).to_dict(),
                                       keep=1)
                self._served(lambda: self.client.load_lora(path))
            else:
                path = publish_full(state, self.folder, start_step)
                self._served(lambda: self.client.reload_weights(path))
            handover.write_serving(self.run_dir, handover.Policy(start_step, str(path), self.lora is not None))
        host_barrier(self.wait_group)
        if self.lora is not None:
            self.client.served = LORA_NAME  # every rank's client asks for the adapter from now on
        self.serving = start_step

    def _served(self, call: Callable[[], T]) -> T:
        """``call``'s answer, from the server the supervisor hands over when this one is lost (module docstring)."""
        while True:
            try:
                return call()
            except ServerUnresponsive as lost:
                handover.report_lost(self.run_dir, self.start, self.env.rank, str(lost))
                print(f"rank {self.env.rank}: {lost}; waiting for a new generation server", flush=True)
                if not self._follow(wait_s=REPLACEMENT_BOUND_S):
                    raise

    def _follow(self, wait_s: float = 0.0) -> bool:
        """Talk to the newest server the supervisor handed over (waiting up to ``wait_s`` for one newer than the
        current); True when it changed."""
        until = time.monotonic() + wait_s
        while True:
            served = handover.read_address(self.run_dir)
            if served is not None and served.start > self.start:
                self.start, self.client.http.base_url = served.start, f"http://{served.address}"
                return True
            if time.monotonic() >= until:
                return False
            time.sleep(POLL_S)

    def generate(self, prompt_ids: list[list[int]], generator: torch.Generator) -> SampledCompletions:
        """A lost server's request is asked again of its replacement (``_served``), with the same seeds."""
        return generate_groups(self._request, self.options, prompt_ids, generator, self.pad_id)

    def _request(self, prompts: list[list[int]], **request):
        return self._served(lambda: self.client.generate(prompts, **request))


def generate_groups(request, options, prompt_ids: list[list[int]], generator: torch.Generator,
                    pad_id: int) -> SampledCompletions:
    """The completions of ``prompt_ids`` (groups of ``num_generations`` equal prompts, consecutive: rounds.py) from
    a vLLM engine's ``request`` (the server's, through VllmGeneration._request, or the colocated engine's generate
    in colocate.py), which take the same arguments. One request per group with n = num_generations and a seed of its
    own (``group_seeds``), from a base drawn from the rank's round generator: the same prompts and round give the
    same request on either engine."""
    n = options.num_generations
    unique = prompt_ids[::n]
    if [p for p in unique for _ in range(n)] != prompt_ids:
        raise ValueError("vLLM generation expects each prompt repeated num_generations times, consecutively")
    base = int(torch.randint(0, SEED_LIMIT, (1,), generator=generator, device=generator.device))
    sampled = request(unique, n=n, seeds=group_seeds(base, len(unique), n), max_tokens=options.max_new_tokens,
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
