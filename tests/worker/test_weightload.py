"""Each rank reading its own shards (jobs/model/weightload.py) gives bitwise the model the rank-0 read + broadcast
gives,
on real gloo ranks: tiny families, tied embeddings, bf16 files for fp32 training, sharded files, a bare-model
checkpoint (no base-model prefix), uneven shards on 3 ranks, HSDP, activation checkpointing and CPU offload;
the checkpoints transformers converts on load keep the rank-0 path; training is unchanged."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from distributed import run_ranks
from families import save_tiny_family
from test_model import _train

pytestmark = pytest.mark.distributed

# transformers renames or fuses these checkpoints' tensors on load (docs/reference/families.md): rank-0 path.
CONVERTED = {"mixtral", "gpt_neox"}
FAMILIES = ("llama", "qwen2", "gemma", "phi", "gpt2", "falcon", "olmo2", *sorted(CONVERTED))


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().to_local() if hasattr(t, "to_local") else t.detach()
    return t.contiguous().view(-1).view(torch.uint8) if t.numel() else t.reshape(0).to(torch.uint8)


def _local_state(model) -> dict[str, torch.Tensor]:
    tensors = [*model.named_parameters(), *model.named_buffers()]
    return {name: _bits(t).clone() for name, t in tensors if t is not None}


def _load_both_ways(rank: int, world_size: int, cases: dict[str, dict], replicate_degree: int = 1) -> dict:
    """Per case: which path the default took, the names whose local bytes differ from the rank-0 path, and the
    losses of 3 training steps each way."""
    import os

    import torch.distributed as dist

    from fsdpjob.jobs.dist import close_distributed, init_distributed
    from fsdpjob.jobs.model import FULL, NONE, load_model, weightload
    from fsdpjob.jobs.model.parallelize import build_mesh

    env = init_distributed(120)
    mesh = build_mesh(env, replicate_degree)
    reads = []
    original = weightload.read_pieces
    weightload.read_pieces = lambda pieces: reads.append(len(pieces)) or original(pieces)
    out = {}
    for name, case in cases.items():
        options = dict(
            dtype=case.get("dtype", torch.float32), attn_implementation="eager", mixed_precision="fp32",
            reshard_after_forward=True, activation_checkpointing=FULL if case.get("ac") else NONE,
            cpu_offload=case.get("offload", False),
        )  # fmt: skip
        states, losses = {}, {}
        for way in ("sharded", "rank0"):
            os.environ[weightload.SWITCH] = way
            reads.clear()
            model = load_model(case["path"], env=env, mesh=mesh, **options)
            states[way], used = _local_state(model), bool(reads)
            if way == "sharded":
                out[name] = {"sharded": used}
            shards, part = world_size // replicate_degree, rank % (world_size // replicate_degree)
            rows = slice(part * 4 // shards, (part + 1) * 4 // shards)
            losses[way] = _train(model, 3, rows) if case.get("train") else []
        os.environ.pop(weightload.SWITCH)
        out[name]["differ"] = sorted(k for k in states["rank0"]
                                     if not torch.equal(states["rank0"][k], states["sharded"][k]))
        out[name]["same_names"] = states["rank0"].keys() == states["sharded"].keys()
        out[name]["losses"] = losses
    dist.barrier()
    close_distributed()
    return out


def _save_bare_llama(path: Path) -> None:
    """The bare LlamaModel of a tied Llama: its file names lack the ``model.`` prefix (and it has no lm_head)."""
    from families import tiny_config
    from transformers import AutoModel

    torch.manual_seed(3)
    AutoModel.from_config(tiny_config("llama", tie_word_embeddings=True)).save_pretrained(path)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("weightload")
    cases: dict[str, dict] = {}
    for family in FAMILIES:
        save_tiny_family(tmp / family, family)
        cases[family] = {"path": str(tmp / family)}
    cases["llama"]["train"] = True
    save_tiny_family(tmp / "tied", "llama", tie_word_embeddings=True)
    cases["tied"] = {"path": str(tmp / "tied"), "train": True}
    model = save_tiny_family(tmp / "bf16", "qwen2", seed=1)
    model.to(torch.bfloat16).save_pretrained(tmp / "bf16")
    cases["bf16_file_fp32_params"] = {"path": str(tmp / "bf16")}
    cases["fp32_file_bf16_params"] = {"path": str(tmp / "llama"), "dtype": torch.bfloat16}
    save_tiny_family(tmp / "split", "llama", seed=2).save_pretrained(tmp / "split", max_shard_size="20KB")
    assert (tmp / "split" / "model.safetensors.index.json").is_file()
    cases["sharded_files"] = {"path": str(tmp / "split")}
    _save_bare_llama(tmp / "bare")
    cases["bare_model_prefix"] = {"path": str(tmp / "bare")}
    cases["activation_checkpointing"] = {"path": str(tmp / "llama"), "ac": True}
    cases["cpu_offload"] = {"path": str(tmp / "llama"), "offload": True}
    results = run_ranks(_load_both_ways, 2, timeout=400, cases=cases)
    return {name: [r[name] for r in results] for name in cases}


CASES = (*FAMILIES, "tied", "bf16_file_fp32_params", "fp32_file_bf16_params", "sharded_files", "bare_model_prefix",
         "activation_checkpointing", "cpu_offload")  # fmt: skip


@pytest.mark.parametrize("case", CASES)
def test_own_shards_equal_the_broadcast_load_bitwise(two_ranks, case):
    for rank_result in two_ranks[case]:
        assert rank_result["same_names"] and rank_result["differ"] == [], rank_result["differ"]
        assert rank_result["sharded"] is (case not in CONVERTED)


@pytest.mark.parametrize("case", ["llama", "tied"])
def test_training_is_unchanged(two_ranks, case):
    losses = two_ranks[case][0]["losses"]
    assert losses["sharded"] == losses["rank0"] and losses["sharded"][-1] < losses["sharded"][0]


def test_uneven_shards_on_three_ranks_and_hsdp_on_four(tmp_path):
    # vocab 256, hidden 32, intermediate 64 rows over 3 ranks: 86/86/84, 11/11/10, 22/22/20 rows.
    save_tiny_family(tmp_path / "m", "qwen2", tie_word_embeddings=True)
    cases = {"m": {"path": str(tmp_path / "m")}}
    for world, replicate in ((3, 1), (4, 2)):
        for rank_result in run_ranks(_load_both_ways, world, timeout=300, cases=cases, replicate_degree=replicate):
            result = rank_result["m"]
            assert result["sharded"] and result["same_names"] and result["differ"] == [], (world, result)


def test_names_map_through_ties_and_the_base_model_prefix():
    from fsdpjob.jobs.model.weightload import map_names

    expected = {"model.embed.weight", "model.norm.weight", "lm_head.weight"}
    ties = [["model.embed.weight", "lm_head.weight"]]
    assert map_names(expected, {"model.embed.weight", "model.norm.weight"}, ties, "model") == {
        "model.embed.weight": "model.embed.weight", "model.norm.weight": "model.norm.weight",
        "lm_head.weight": "model.embed.weight",
    }  # fmt: skip
    assert map_names(expected, {"embed.weight", "norm.weight"}, ties, "model")["lm_head.weight"] == "embed.weight"
    assert map_names(expected, {"model.embed.weight", "model.norm.weight", "extra"}, ties, "model") is None
    assert map_names(expected, {"model.embed.weight"}, ties, "model") is None


def test_the_planner_knows_which_checkpoints_each_rank_reads_itself(tmp_path):
    """The planner's rule (planner/memory.py reads_own_shards, no torch there) against the worker's name mapping."""
    from types import SimpleNamespace

    from families import PLANNED_FAMILIES

    from fsdpjob.jobs.model.build import _tie_groups
    from fsdpjob.jobs.model.weightload import map_names, stored_tensors
    from fsdpjob.orchestrator.planner.memory import reads_own_shards
    from fsdpjob.orchestrator.planner.modelshape import read_model_shape

    wrong = []
    for family in PLANNED_FAMILIES:
        model = save_tiny_family(tmp_path / family, family)
        expected, stored = set(model.state_dict()), set(stored_tensors(tmp_path / family))
        worker = map_names(expected, stored, _tie_groups(model), model.base_model_prefix) is not None
        if reads_own_shards(read_model_shape(tmp_path / family), SimpleNamespace(lora=None)) != worker:
            wrong.append(family)
    assert wrong == []
