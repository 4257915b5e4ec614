"""Generation on grpo's generation server (``generator: {backend: server}``): the supervisor started it for this
launch (orchestrator/supervise/genserver.py) and passes its address in FSDPJOB_GENERATION_SERVER. Before each
round the ranks publish the policy (LoRA: the adapters only) and rank 0 has the server load it as version = the
round's first step; then each rank asks for its own prompts' completions with a seed drawn from its round
generator. Every call has the spec's deadline (client.py): a frozen server makes the step fail, and the
supervisor restarts the training step and a new server in the allocation.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from fsdpjob.orchestrator.core import envvars
from fsdpjob.orchestrator.core.genserver.client import GenerationClient, publish_weights

from ..dist import DistEnv, host_barrier
from ..model.lora import is_adapter_key, lora_config


@dataclass
class RemoteCompletions:
    completion_ids: torch.Tensor  # [N, T] padded after the end
    mask: torch.Tensor  # [N, T] the completion's tokens


class RemoteGeneration:
    """The rounds' ``generate`` and ``before_round`` over the server."""

    def __init__(self, spec, model: torch.nn.Module, env: DistEnv, run_dir: Path, pad_id: int,
                 control: dist.ProcessGroup | None):
        address = envvars.get("FSDPJOB_GENERATION_SERVER")
        if not address:
            raise RuntimeError(f"grpo.generator.backend is {spec.grpo.generator.backend} but no generation server "
                               "was started for this launch (FSDPJOB_GENERATION_SERVER unset): run it through "
                               "fsdpjob submit")
        self.options, self.model, self.env, self.pad_id, self.control = spec.grpo, model, env, pad_id, control
        self.lora = spec.model.lora
        self.client = GenerationClient(f"http://{address}", deadline_s=spec.grpo.generator.deadline_s)
        self.folder = run_dir / "generation-server" / "weights"
        self.address = address

    def before_round(self, start_step: int) -> None:
        """The policy of step ``start_step`` on the server (every rank: the gather is a collective)."""
        if start_step == 0:  # the starting weights are the server's own (LoRA's B starts at 0: the base)
            if self.env.is_main and self.client.health()["version"] != 0:
                raise RuntimeError("the generation server serves trained weights at step 0: it was not restarted")
            return
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if self.env.is_main:
            config = None
            if self.lora is not None:
                state = {k: v for k, v in state.items() if is_adapter_key(k)}
                config = lora_config(self.lora).to_dict()
            path = publish_weights(state, self.folder, start_step, lora_config=config)
            self.client.ensure_version(path, start_step)
        host_barrier(self.control)

    def generate(self, prompt_ids: list[list[int]], generator: torch.Generator) -> RemoteCompletions:
        seed = int(torch.randint(0, 2**31 - 1, (1,), generator=generator, device=generator.device))
        ids = self.client.generate(prompt_ids, max_tokens=self.options.max_new_tokens,
                                   temperature=self.options.temperature, top_p=self.options.top_p, n=1, seed=seed)
        width = self.options.max_new_tokens
        out = torch.full((len(ids), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(ids), width), dtype=torch.bool)
        for i, row in enumerate(ids):
            out[i, :len(row)] = torch.tensor(row[:width], dtype=torch.long)
            mask[i, :len(row)] = True
        return RemoteCompletions(out, mask)
