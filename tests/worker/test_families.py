"""Every family in tests/families.py loads into FSDP2 on 2 gloo ranks and trains with falling loss,
whatever its block layout (model.layers, transformer.h, gpt_neox.layers): one process pair for all."""

from __future__ import annotations

import pytest
import torch
from distributed import run_ranks
from families import FAMILIES, VOCAB, save_tiny_family

from fsdpjob.orchestrator.core.jobspec.spec import ModelSpec

pytestmark = pytest.mark.distributed
DEFAULT_ATTENTION = ModelSpec.model_fields["attn_implementation"].default

STEPS, ROWS, SEQ = 6, 4, 32
# Activation checkpointing must wrap the same blocks: on for one family of each layout.
CHECKPOINTED = {"llama", "gpt2", "gpt_neox", "falcon"}


def _train_families(rank: int, world_size: int, folders: dict[str, str]) -> dict[str, dict]:
    import torch.distributed as dist

    from fsdpjob.jobs.dist import close_distributed, init_distributed
    from fsdpjob.jobs.model import FULL, NONE, find_decoder_layers, load_model
    from fsdpjob.jobs.model.parallelize import build_mesh

    env = init_distributed(120)
    mesh = build_mesh(env, 1)
    ids = torch.randint(3, VOCAB, (ROWS, SEQ), generator=torch.Generator().manual_seed(7))
    mine = ids[rank * ROWS // world_size : (rank + 1) * ROWS // world_size]
    out: dict[str, dict] = {}
    for family, folder in folders.items():
        try:
            model = load_model(  # the spec's default attention: the worker picks what each family can run
                folder, env=env, mesh=mesh, dtype=torch.float32, attn_implementation=DEFAULT_ATTENTION,
                mixed_precision="fp32",
                reshard_after_forward=True, activation_checkpointing=FULL if family in CHECKPOINTED else NONE,
                cpu_offload=False,
            )  # fmt: skip
            opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
            losses = []
            for _ in range(STEPS):
                loss = model(input_ids=mine, labels=mine, use_cache=False).loss
                loss.backward()
                opt.step()
                opt.zero_grad()
                value = loss.detach().clone()
                dist.all_reduce(value, op=dist.ReduceOp.AVG)
                losses.append(value.item())
            layers = find_decoder_layers(model)
            out[family] = {"losses": losses, "blocks": len(layers), "error": None}
        except Exception as exc:  # one family's failure is its own test's failure
            out[family] = {"losses": [], "blocks": 0, "error": f"{type(exc).__name__}: {exc}"}
    close_distributed()
    return out


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict[str, dict]:
    tmp = tmp_path_factory.mktemp("families")
    folders = {}
    for family in FAMILIES:
        save_tiny_family(tmp / family, family)
        folders[family] = str(tmp / family)
    results = run_ranks(_train_families, 2, timeout=400, folders=folders)
    assert results[0] == results[1]
    return results[0]


@pytest.mark.parametrize("family", FAMILIES)
def test_family_trains_on_two_ranks_with_falling_loss(trained, family):
    result = trained[family]
    assert result["error"] is None, result["error"]
    losses = result["losses"]
    assert all(torch.isfinite(torch.tensor(losses))), losses
    assert losses[-1] < losses[0] - 0.05, losses
    assert result["blocks"] == 2  # each decoder block is its own FSDP unit


def test_blocks_are_found_through_no_split_modules_outside_model_layers():
    from families import tiny_config
    from transformers import AutoModelForCausalLM

    from fsdpjob.jobs.model import find_decoder_layers

    for family, where in (("gpt2", "transformer.h"), ("gpt_neox", "gpt_neox.layers"), ("falcon", "transformer.h")):
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(tiny_config(family))
        assert find_decoder_layers(model) is model.get_submodule(where), family


