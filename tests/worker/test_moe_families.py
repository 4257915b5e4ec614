"""The mixture-of-experts families (tests/families.py MOE_FAMILIES) on 2 gloo ranks with FSDP2 and the SFT step
(jobs/step.py): loss falls with the load-balancing loss in it, the router metrics come with the step's values, a
stop at step 3 and a resume continue bitwise, and the checkpoint exports to a folder transformers loads."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from distributed import run_ranks
from families import MOE_FAMILIES, VOCAB, save_tiny_family, tiny_config

from fsdpjob.orchestrator.core.jobspec.spec import ModelSpec

pytestmark = [pytest.mark.distributed, pytest.mark.xdist_group("moe_families")]  # one fixture run, not one per worker
DEFAULT_ATTENTION = ModelSpec.model_fields["attn_implementation"].default
STEPS, SAVED, MICRO, SEQ = 6, 3, 2, 24
CHECKPOINTED = {"mixtral"}  # full activation checkpointing: the recompute in backward must not count twice


def _micro_batches(step: int, rank: int) -> list[SimpleNamespace]:
    """The same rows at every step (random tokens: only memorising them lowers the loss), its own per rank."""
    gen = torch.Generator().manual_seed(1000 + rank)
    ids = torch.randint(3, VOCAB, (MICRO, 1, SEQ), generator=gen)
    return [SimpleNamespace(input_ids=row, labels=row.clone(), position_ids=None) for row in ids]


def _train_family(env, mesh, folder: str, root: Path, family: str) -> dict:
    import torch.distributed as dist
    from ckpt_driver import manager
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from fsdpjob.jobs.checkpoint import step_dir_name
    from fsdpjob.jobs.checkpoint.state import ModelOptimState
    from fsdpjob.jobs.model import FULL, NONE, load_model
    from fsdpjob.jobs.step import train_step

    model = load_model(folder, env=env, mesh=mesh, dtype=torch.float32, attn_implementation=DEFAULT_ATTENTION,
                       mixed_precision="fp32", reshard_after_forward=True, cpu_offload=False,
                       activation_checkpointing=FULL if family in CHECKPOINTED else NONE)  # fmt: skip
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    tokens = dist.get_world_size() * MICRO * (SEQ - 1)
    cpu = torch.device("cpu")

    def step(n: int):
        return train_step(model, opt, _micro_batches(n, env.rank), cpu, tokens=tokens, max_grad_norm=1.0)

    losses, extras = [], []
    ckpt = manager(root, env.rank, dist.get_world_size(), sidecar={"model_path": folder})
    state = {"model": ModelOptimState(model, opt), "train": {"step": SAVED}}
    for n in range(1, STEPS + 1):
        values = step(n)
        losses.append(values.loss)
        extras.append(values.extra())
        if n == SAVED:
            ckpt.save(SAVED, state, reason="interval")
            saved = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
            saved = {k: v.detach().clone() for k, v in saved.items()}
    ckpt.wait()
    ckpt.load(root / step_dir_name(SAVED), state)
    resumed = [step(n).loss for n in range(SAVED + 1, STEPS + 1)]
    ckpt.close()
    if env.rank == 0:
        torch.save(saved, root / "saved.pt")
    return {"losses": losses, "resumed": resumed, "extras": extras, "error": None}


def _train_families(rank: int, world_size: int, folders: dict[str, str], roots: dict[str, str]) -> dict[str, dict]:
    from fsdpjob.jobs.dist import close_distributed, init_distributed
    from fsdpjob.jobs.model.parallelize import build_mesh

    env = init_distributed(120)
    mesh = build_mesh(env, 1)
    out: dict[str, dict] = {}
    for family, folder in folders.items():
        try:
            out[family] = _train_family(env, mesh, folder, Path(roots[family]), family)
        except Exception as exc:  # one family's failure is its own test's failure
            out[family] = {"losses": [], "error": f"{type(exc).__name__}: {exc}"}
    close_distributed()
    return out


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict[str, dict]:
    tmp = tmp_path_factory.mktemp("moe")
    folders, roots = {}, {}
    for family in MOE_FAMILIES:
        save_tiny_family(tmp / family, family)
        folders[family], roots[family] = str(tmp / family), str(tmp / "runs" / family / "checkpoints")
    results = run_ranks(_train_families, 2, timeout=600, folders=folders, roots=roots)
    for family in MOE_FAMILIES:
        results[0][family]["root"] = roots[family]
    return results[0]


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_moe_family_trains_with_router_metrics(trained, family):
    result = trained[family]
    assert result["error"] is None, result["error"]
    losses = result["losses"]
    assert all(torch.isfinite(torch.tensor(losses))), losses
    assert losses[-1] < losses[0] - 0.05, losses
    extras = result["extras"]
    layers = tiny_config(family).num_hidden_layers - getattr(tiny_config(family), "first_k_dense_replace", 0)
    for extra in extras:
        imbalance = [extra[f"moe_imbalance_l{i}"] for i in range(layers)]
        assert all(1.0 <= value <= 4 / 2 for value in imbalance), extra  # 4 experts, top 2: at most 2
        assert extra["moe_imbalance_max"] == max(imbalance)
        assert extra["moe_aux_loss"] > 0  # Switch's loss: ~top_k (2) at balance
        assert f"moe_imbalance_l{layers}" not in extra


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_moe_family_resumes_bitwise_and_exports(trained, family, tmp_path):
    from transformers import AutoModelForCausalLM

    from fsdpjob.jobs.checkpoint import step_dir_name
    from fsdpjob.jobs.export import export_from_path

    result = trained[family]
    assert result["error"] is None, result["error"]
    assert result["resumed"] == result["losses"][SAVED:]  # bitwise: the same floats
    root = Path(result["root"])
    export_from_path(root / step_dir_name(SAVED), tmp_path / "hf", "fp32")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).state_dict()
    saved = torch.load(root / "saved.pt")
    assert sorted(reloaded) == sorted(saved)
    assert all(torch.equal(reloaded[k], saved[k]) for k in saved), family
