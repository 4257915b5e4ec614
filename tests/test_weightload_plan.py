"""Planner: host RAM at load follows the workers' weight read (each rank its own shards where safetensors are there)."""

from __future__ import annotations

from pathlib import Path

import pytest
from specs import plan_spec, write_config
from test_planner import A100, LLAMA2_70B

from fsdpjob.orchestrator.planner.fit import make_plan
from fsdpjob.orchestrator.planner.memory import CUDA_PROCESS_BYTES
from fsdpjob.orchestrator.planner.resolve import resolve
from fsdpjob.orchestrator.views.plan import format_plan


def _plan(folder: Path, weights: str | None, **cfg):
    write_config(folder, {**LLAMA2_70B, **cfg})
    if weights:
        (folder / weights).write_bytes(b"")  # the listing decides; an unreadable header only stops the exact count
    return make_plan(resolve(plan_spec(folder, resources={"nodes": 2}), A100))


def test_safetensors_weights_need_no_full_copy_on_rank_0(tmp_path: Path) -> None:
    plain = _plan(tmp_path / "config-only", None)
    own = _plan(tmp_path / "with-weights", "model.safetensors")
    assert not plain.host.own_shards and own.host.own_shards
    process = 8 * CUDA_PROCESS_BYTES  # the workers' own RSS
    assert plain.host.load_rank0 == pytest.approx(68.98e9 * 2 + process, rel=0.01)  # one fp16 copy on rank 0
    # 8 ranks per node, each holding one 16th of the largest tensor (the embedding) in fp16 while it reads
    assert own.host.load_rank0 == 8 * (32000 * 8192 // 16) * 2 + process
    assert own.host.load_rank0 - process < 0.05 * (plain.host.load_rank0 - process)
    text = format_plan(own)
    assert "load, own shards" in text and "rank-0 loading" not in text
    assert own.to_json()["host_memory"]["own_shards"] is True


@pytest.mark.parametrize("weights", ["model.safetensors", "model.safetensors.index.json"])
def test_checkpoints_transformers_converts_keep_the_rank_0_figure(tmp_path: Path, weights: str) -> None:
    assert _plan(tmp_path / "llama", weights).host.own_shards
    moe = _plan(tmp_path / "mixtral", weights, model_type="mixtral", num_local_experts=8, num_experts_per_tok=2)
    assert not moe.host.own_shards and moe.host.load_rank0 > 2 * 68.98e9
