"""Planner: parameter counts against transformers, the Llama-2-70B seed case, fixes, signal lead, CPU mode."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from specs import plan_spec, write_config

from fsdpjob.orchestrator.core.errors import InputError
from fsdpjob.orchestrator.core.jobspec.profiles import load_profile
from fsdpjob.orchestrator.core.jobspec.spec import JobSpec
from fsdpjob.orchestrator.core.jobspec.yamlio import apply_overrides
from fsdpjob.orchestrator.core.units import GiB
from fsdpjob.orchestrator.planner.fit import make_plan
from fsdpjob.orchestrator.planner.memory import (
    CUBLAS_WORKSPACE_BYTES,
    CUDA_CONTEXT_BYTES,
    CUDA_PROCESS_BYTES,
    NCCL_COMMUNICATOR_BYTES,
    tier_rank_bytes,
    usable_gpu_memory,
)
from fsdpjob.orchestrator.planner.modelshape import count_params, read_model_shape
from fsdpjob.orchestrator.planner.resolve import resolve
from fsdpjob.orchestrator.views.plan import format_plan

# Public config.json values of meta-llama/Llama-2-70b-hf.
LLAMA2_70B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 32000,
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "num_hidden_layers": 80,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-05,
    "tie_word_embeddings": False,
    "torch_dtype": "float16",
}


def with_changes(spec: JobSpec, change: str) -> JobSpec:
    """Apply a fix's `a.b=v a.c=w` change the way `--set` would."""
    return JobSpec.model_validate(apply_overrides(spec.model_dump(mode="json"), change.split()))


@pytest.fixture
def seed_70b(tmp_path: Path) -> JobSpec:
    """The seed recipe: Llama-2-70B, 2 nodes x 8 A100-80GB, fp32 master weights, bf16 compute, AC, seq 2048, mb 1."""
    return plan_spec(
        write_config(tmp_path / "llama-2-70b", LLAMA2_70B),
        resources={"nodes": 2},
        model={"activation_checkpointing": True},
        data={"seq_len": 2048},
        fsdp={"separate_root": False},  # the recipe's root unit, held gathered (auto separates it: its own test)
    )


A100 = load_profile("a100-80gb")


# ------------------------------------------------------------------------------------------------
# Parameter counts.

TINY = dict(vocab_size=211, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4)


def _transformers_config(model_type: str, **kw):
    from transformers import AutoConfig

    return AutoConfig.for_model(model_type, **{**TINY, **kw})


@pytest.mark.parametrize(
    "model_type, extra",
    [
        ("llama", {"num_key_value_heads": 2, "tie_word_embeddings": False}),
        ("llama", {"num_key_value_heads": 4, "tie_word_embeddings": True}),
        ("llama", {"num_key_value_heads": 2, "attention_bias": True, "mlp_bias": True}),
        ("llama", {"num_key_value_heads": 2, "head_dim": 32}),
        ("mistral", {"num_key_value_heads": 2}),
        ("qwen2", {"num_key_value_heads": 2, "tie_word_embeddings": True}),
        ("qwen2", {"num_key_value_heads": 2, "tie_word_embeddings": False}),
        ("qwen3", {"num_key_value_heads": 2, "head_dim": 24}),
        ("qwen3", {"num_key_value_heads": 2, "attention_bias": True, "tie_word_embeddings": True}),
        ("granite", {"num_key_value_heads": 2}),
    ],
)
def test_param_count_matches_transformers(tmp_path: Path, model_type: str, extra: dict) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    cfg = _transformers_config(model_type, **extra)
    cfg.save_pretrained(tmp_path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    expected = sum(p.numel() for p in model.parameters())  # shared (tied) parameters once
    counted = count_params(read_model_shape(tmp_path))
    assert counted.total == expected
    layer = model.model.layers[0]
    assert counted.per_layer == sum(p.numel() for p in layer.parameters())
    assert (counted.lm_head == 0) == bool(cfg.tie_word_embeddings)


def test_keys_left_out_of_config_json_take_the_transformers_defaults(tmp_path: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    # Qwen3Config defaults head_dim to 128 and the Qwen configs 32 kv heads; Mistral 8; Llama = heads.
    for model_type in ("qwen3", "qwen2", "mistral", "llama", "granite"):
        folder = write_config(tmp_path / model_type, {"model_type": model_type, **TINY})
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
        assert count_params(read_model_shape(folder)).total == sum(p.numel() for p in model.parameters()), model_type


def test_llama2_70b_count_is_the_published_one(seed_70b: JobSpec) -> None:
    counted = count_params(read_model_shape(seed_70b.model.path))
    assert counted.total == 68_976_648_192  # "68.98B" on the model card
    assert counted.per_layer == 855_654_400


def test_an_unknown_model_type_is_planned_with_a_stated_estimate(tmp_path: Path) -> None:
    write_config(tmp_path, {**LLAMA2_70B, "model_type": "not_a_family"})
    shape = read_model_shape(tmp_path)
    assert "'not_a_family'" in shape.estimate and "estimated" in shape.estimate
    write_config(tmp_path, {**LLAMA2_70B, "model_type": "mixtral", "num_local_experts": 8})
    assert read_model_shape(tmp_path).estimate is None  # a known family: counted from config.json


def test_missing_config_and_bad_json_are_one_line_errors(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="config.json: model.path: not found"):
        read_model_shape(tmp_path)
    (tmp_path / "config.json").write_text('{"model_type": "llama",\n oops}')
    with pytest.raises(InputError, match="line 2: not valid JSON"):
        read_model_shape(tmp_path)
    write_config(tmp_path, {k: v for k, v in LLAMA2_70B.items() if k != "hidden_size"})
    with pytest.raises(InputError, match="hidden_size / n_embd / d_model / dim is missing"):
        read_model_shape(tmp_path)


# ------------------------------------------------------------------------------------------------
# The golden seed case.


def test_seed_70b_fits_on_three_a100_nodes_not_two(seed_70b: JobSpec) -> None:
    # Two nodes: the first layer's backward (all sharded gradients + its transients, grad_accum 1) peaks above the
    # 79.1 GiB an 80 GB A100 gives torch but below the nominal 80: planned against usable memory, it does not fit.
    two = make_plan(resolve(seed_70b, A100))
    assert two.device.peak_moment.name == "backward, first layer"
    assert two.device.budget == int(79.1 * GiB) < two.device.peak < 80 * GiB and not two.fits
    # The root as units of its own (issue 41's saver) frees the head and its gradient during the layers' backward
    # (~1 GiB), but lands at 78.7 of 79.1 GiB: under the 3 % headroom a fix must leave (issue 54), so it is not
    # offered alone. Then the recipe's own configuration (bf16 weights): it costs no speed, unlike offload or a node.
    assert [f.change for f in two.fixes] == ["model.dtype=bfloat16", "fsdp.cpu_offload=true", "resources.nodes=3"]
    assert all(f.peak <= 0.97 * two.device.budget for f in two.fixes)
    separated = make_plan(resolve(with_changes(seed_70b, "fsdp.separate_root=true"), A100))
    assert separated.fits and 78 * GiB < separated.device.peak < 79.1 * GiB and separated.fixes  # tight: fixes shown
    bf16 = two.fixes[0]
    assert 40 * GiB < bf16.peak < 50 * GiB and "round away" in bf16.why  # ~46 GiB, and what it costs in accuracy
    assert make_plan(resolve(with_changes(seed_70b, bf16.change), A100)).fits
    plan = make_plan(resolve(with_changes(seed_70b, "resources.nodes=3"), A100))
    assert plan.fits and plan.device.fits and plan.host.fits
    state = sum(i.bytes for i in plan.device.breakdown if i.name in ("parameters", "gradients", "AdamW state"))
    assert state < 16 * 68.98e9 / 24 < plan.device.peak  # ~46 GB of model state per GPU (less the first layer's grads)
    assert plan.setup.world == 24 and plan.setup.shard_degree == 24
    assert plan.host.load_every_rank == pytest.approx(2.2e12, rel=0.03)  # 70e9 x 4 B x 8 ranks
    # One fp16 copy (the checkpoint's dtype) on rank 0; the fp32 shards are materialized on the GPUs; 8 CUDA processes.
    assert plan.host.load_rank0 == pytest.approx(68.98e9 * 2 + 8 * CUDA_PROCESS_BYTES, rel=0.03)
    assert plan.host.load_every_rank > plan.host.budget  # why rank-0 loading: 2 TB nodes cannot load on every rank
    assert plan.fixes == () and plan.warnings == ()


def test_usable_gpu_memory_and_the_headroom_warning(seed_70b: JobSpec) -> None:
    """The budget is what torch can allocate: by gpu_type, the profile's own figure, or nominal less 1.1 %; a plan
    that fits with under 3 % of it left is flagged."""
    three = with_changes(seed_70b, "resources.nodes=3")
    peak = make_plan(resolve(three, A100)).device.peak
    h200 = load_profile("h200")
    assert usable_gpu_memory(h200) == (int(139.5 * GiB), "what torch sees of a 141 GiB H200-SXM-141GB")
    odd = A100.model_copy(update={"gpu_type": "X1", "gpu_memory_gb": 96.0})
    assert usable_gpu_memory(odd)[0] == int(96 * 0.989 * GiB) and "gpu_usable_memory_gb" in usable_gpu_memory(odd)[1]
    tight = A100.model_copy(update={"gpu_usable_memory_gb": peak / GiB * 1.02})
    plan = make_plan(resolve(three, tight))
    assert plan.fits and plan.device.budget == int(peak * 1.02)
    assert len(plan.warnings) == 1 and plan.warnings[0].startswith("GPU headroom") and "usable" in plan.warnings[0]
    assert "the profile's gpu_usable_memory_gb" in format_plan(plan)


def test_the_cuda_runtime_is_a_stated_estimate_per_nccl_communicator(seed_70b: JobSpec) -> None:
    flat = make_plan(resolve(with_changes(seed_70b, "resources.nodes=3"), A100))
    hsdp = make_plan(resolve(with_changes(seed_70b, "resources.nodes=4 fsdp.replicate_degree=2"), A100))
    runtime = {p.setup.replicate_degree: next(i for i in p.device.breakdown if i.name == "CUDA runtime (assumed)")
               for p in (flat, hsdp)}
    assert runtime[2].bytes - runtime[1].bytes == 2 * NCCL_COMMUNICATOR_BYTES  # HSDP's two mesh groups
    assert runtime[1].bytes == CUDA_CONTEXT_BYTES + CUBLAS_WORKSPACE_BYTES + NCCL_COMMUNICATOR_BYTES
    assert "x 3 communicators" in runtime[2].note and "x 1 communicator " in runtime[1].note
    assert "assumed, not measured: CUDA runtime context 0.50 + cuBLAS 0.12 + NCCL 0.50 x 1 communicator" in \
        format_plan(flat)


def test_seed_70b_on_one_node_needs_offload_or_a_second_node(seed_70b: JobSpec) -> None:
    one = with_changes(seed_70b, "resources.nodes=1")
    plan = make_plan(resolve(one, A100))
    assert not plan.fits
    state = sum(i.bytes for i in plan.device.breakdown if i.name in ("parameters", "gradients", "AdamW state"))
    assert state == pytest.approx(138e9, rel=0.01)  # ~140 GB per GPU for model state alone
    changes = [f.change for f in plan.fixes]
    assert changes == ["fsdp.cpu_offload=true", "resources.nodes=3"]  # AC is on already; mb is 1; bf16 is not enough
    offload = plan.fixes[0]
    assert offload.saves > 100 * GiB and offload.peak < 20 * GiB
    assert any("does not fit" in w and "per GPU" in w for w in plan.warnings)
    assert "DOES NOT FIT" in format_plan(plan)
    host = make_plan(resolve(with_changes(one, offload.change), A100)).host
    assert host.offloaded_per_rank == pytest.approx(16 * 68.98e9 / 8, rel=0.01)  # params + grads + AdamW, fp32
    assert host.training == 8 * (host.offloaded_per_rank + CUDA_PROCESS_BYTES) and host.fits  # 1.1 TB of 2 TB


def test_every_fix_fits_and_they_come_cheapest_first(seed_70b: JobSpec) -> None:
    # On 4 nodes: on 2, the first layer's backward with every gradient held leaves no single change that fits.
    spec = with_changes(seed_70b, "model.activation_checkpointing=false train.micro_batch_size=4 resources.nodes=4")
    plan = make_plan(resolve(spec, A100))
    assert not plan.fits
    order = ["model.activation_checkpointing", "train.micro_batch_size", "model.dtype", "fsdp.cpu_offload",
             "resources.nodes"]
    ranks = [min(i for i, key in enumerate(order) if key in f.change) for f in plan.fixes]
    assert ranks == sorted(ranks) and ranks[0] == 0
    for fix in plan.fixes:
        fixed = make_plan(resolve(with_changes(spec, fix.change), A100))
        assert fixed.fits, fix.change
        assert fixed.device.peak == fix.peak and fix.saves == plan.device.peak - fix.peak


def test_micro_batch_fix_keeps_the_global_batch(tmp_path: Path) -> None:
    eight_layers = write_config(tmp_path, {**LLAMA2_70B, "num_hidden_layers": 8})
    spec = plan_spec(eight_layers, data={"seq_len": 4096}, train={"micro_batch_size": 8, "grad_accum_steps": 2})
    plan = make_plan(resolve(spec, A100))
    first_keys = [f.change.split()[0] for f in plan.fixes]
    # Full AC, or a smaller micro-batch (selective AC, issue 41, would land under the 3 % headroom a fix must leave)
    assert first_keys == ["model.activation_checkpointing=true", "train.micro_batch_size=3"]
    changed = with_changes(spec, plan.fixes[1].change)
    assert changed.train.grad_accum_steps == 6  # ceil(8 x 2 / 3): the global batch does not shrink
    assert make_plan(resolve(changed, A100)).fits


# ------------------------------------------------------------------------------------------------
# Time: checkpoint, step, signal lead.


def test_checkpoint_size_and_save_time(seed_70b: JobSpec) -> None:
    t = make_plan(resolve(seed_70b, A100)).timing
    assert t.checkpoint_bytes == 68_976_648_192 * 4 * 3  # fp32 params + 2 AdamW moments
    assert t.save_s == pytest.approx(t.checkpoint_bytes / (2.0e9 * 2))  # 2 GB/s per node, 2 nodes
    # 6 x N x 16 x 2048 tokens x 4/3 (AC) / 16 GPUs at 40 % of 312 TFLOP/s: about 9 s.
    assert 5 < t.step_s < 15


def test_short_signal_lead_warns_with_the_value_to_use(seed_70b: JobSpec) -> None:
    seed_70b = with_changes(seed_70b, "resources.nodes=3")  # 2 nodes do not fit the usable memory
    short = with_changes(seed_70b, "preemption.signal_lead_s=60")
    plan = make_plan(resolve(short, A100))
    needed = plan.timing.needed_lead_s
    assert needed > plan.timing.step_s + plan.timing.save_s
    assert any(f"set preemption.signal_lead_s: {needed}" in w for w in plan.warnings)
    assert plan.fits  # a warning, not a refusal
    enough = make_plan(resolve(with_changes(seed_70b, f"preemption.signal_lead_s={needed}"), A100))
    assert not any("signal" in w for w in enough.warnings)


def test_unknown_gpu_type_makes_step_time_unknown(seed_70b: JobSpec) -> None:
    profile = A100.model_copy(update={"gpu_type": "Gaudi3-128GB"})
    plan = make_plan(resolve(seed_70b, profile))
    assert plan.timing.step_s is None
    assert any("step time is unknown" in w and "Gaudi3-128GB" in w for w in plan.warnings)


# ------------------------------------------------------------------------------------------------
# CPU profiles, HSDP, output formats, import boundary.


def test_cpu_profile_plans_host_memory_per_rank(tmp_path: Path) -> None:
    tiny = write_config(tmp_path, {**LLAMA2_70B, "hidden_size": 256, "intermediate_size": 688,
                                   "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4,
                                   "vocab_size": 4096, "torch_dtype": "float32"})
    local = load_profile("local")
    plan = make_plan(resolve(plan_spec(tiny, resources={"tasks_per_node": 2}), local))
    assert plan.device.kind == "cpu" and plan.fits
    assert plan.device.budget == int(local.host_ram_gb * GiB / 2)
    assert "CUDA runtime (assumed)" not in [i.name for i in plan.device.breakdown]
    assert plan.host.training == 2 * plan.device.peak
    assert plan.timing.step_s is not None  # CPU throughput is a measured constant


def test_cpu_profile_too_small_proposes_activation_checkpointing(tmp_path: Path) -> None:
    big = write_config(tmp_path, {**LLAMA2_70B, "num_hidden_layers": 6, "torch_dtype": "bfloat16"})
    spec = plan_spec(big, data={"seq_len": 4096}, train={"micro_batch_size": 4})
    profile = load_profile("local").model_copy(update={"host_ram_gb": 140.0})
    plan = make_plan(resolve(spec, profile))
    assert not plan.fits and any("per rank (host RAM / tasks_per_node)" in w for w in plan.warnings)
    # Offload means nothing on CPU and the local profile has one node: activation checkpointing comes first (a
    # smaller micro-batch also fits since the first layer's backward, with every gradient held, sets the peak).
    changes = [f.change for f in plan.fixes]
    assert changes[:2] == ["model.activation_checkpointing=selective", "model.activation_checkpointing=true"]
    assert not any("cpu_offload" in c or "nodes" in c for c in changes)
    assert make_plan(resolve(with_changes(spec, plan.fixes[0].change), profile)).fits


def test_hsdp_shards_over_the_group_only(seed_70b: JobSpec) -> None:
    full = make_plan(resolve(seed_70b, A100))
    hsdp = make_plan(resolve(with_changes(seed_70b, "fsdp.replicate_degree=2"), A100))
    assert hsdp.setup.shard_degree == 8
    params = {p.name: p.bytes for p in hsdp.device.state}
    assert params["parameters"] == 2 * {p.name: p.bytes for p in full.device.state}["parameters"]
    # HSDP that does not fit is never told to offload: the spec refuses fsdp.cpu_offload with replicate_degree.
    tight = make_plan(resolve(with_changes(seed_70b, "fsdp.replicate_degree=2"), A100))
    assert not tight.fits and tight.fixes and all("cpu_offload" not in f.change for f in tight.fixes), tight.fixes


def test_json_has_the_documented_keys_and_round_trips(seed_70b: JobSpec) -> None:
    out = make_plan(resolve(with_changes(seed_70b, "resources.nodes=1"), A100)).to_json()
    assert json.loads(json.dumps(out)) == out
    assert set(out) == {"verdict", "fits", "refusal", "model", "params", "topology", "device_memory", "host_memory",
                        "checkpoint", "step", "signal", "step_plan", "checkpoint_interval", "fixes", "warnings",
                        "generator"}
    assert out["generator"] is None  # not grpo (tests/test_generator_plan.py has its keys)
    assert out["fits"] is False and out["params"]["total"] == 68_976_648_192
    assert out["device_memory"]["peak_bytes"] == sum(i["bytes"] for i in out["device_memory"]["breakdown"])
    assert {"change", "peak_bytes", "saves_bytes", "why"} == set(out["fixes"][0])


def test_text_report_shows_the_breakdown_and_verdict(seed_70b: JobSpec) -> None:
    text = format_plan(make_plan(resolve(with_changes(seed_70b, "resources.nodes=3"), A100)))
    for needle in ("parameters", "AdamW state", "gradients", "CUDA runtime (assumed)", "rank-0 loading",
                   "every rank loading", "checkpoint:", "signal lead:", "verdict: FITS"):
        assert needle in text, needle


def test_planner_imports_neither_torch_nor_transformers() -> None:
    code = (
        "import sys, fsdpjob.orchestrator.planner.fit; "
        "bad = [m for m in ('torch', 'transformers') if m in sys.modules]; "
        "sys.exit(f'imported {bad}' if bad else 0)"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_gradient_sync_is_deferred_to_the_last_micro_batch_only_where_it_fits(tmp_path: Path, seed_70b) -> None:
    """With grad accumulation the plan defers the reduce-scatter to the last micro-batch when the unsharded fp32
    gradients of the whole model fit beside everything else, and counts them; the workers follow its verdict."""
    tiny = write_config(tmp_path / "tiny", {**LLAMA2_70B, "hidden_size": 256, "intermediate_size": 688,
                                            "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4,
                                            "vocab_size": 4096})
    small = make_plan(resolve(plan_spec(tiny, train={"grad_accum_steps": 4}), A100))
    assert small.setup.defer_grad_sync and small.worker_facts()["defer_grad_sync"] is True
    held = {i.name: i.bytes for i in small.device.moments[0].items}
    assert held["accumulated gradients"] == small.params.total * 4
    assert "gradient sync: once per step over 4 micro-batches" in format_plan(small)
    # 70B: 280 GB of unsharded fp32 gradients never fit an 80 GB GPU; every micro-batch reduce-scatters.
    big = make_plan(resolve(with_changes(seed_70b, "train.grad_accum_steps=4"), A100))
    assert not big.setup.defer_grad_sync and big.worker_facts()["defer_grad_sync"] is False
    assert "gradient sync: every micro-batch" in format_plan(big)
    # Without accumulation there is nothing to defer.
    assert not make_plan(resolve(plan_spec(tiny), A100)).setup.defer_grad_sync


def test_async_save_staging_and_cuda_processes_are_in_the_host_plan(seed_70b: JobSpec) -> None:
    """DefaultStager keeps a pinned copy of each rank's params + both AdamW moments between saves; a CUDA worker's
    own RSS (CUDA, cuBLAS, NCCL libraries) is GiBs, not the CPU worker's 0.4 GiB."""
    sync = make_plan(resolve(seed_70b, A100)).host
    staged = make_plan(resolve(with_changes(seed_70b, "checkpoint.async_save=true"), A100)).host
    assert sync.staged_per_rank == 0 and sync.process_per_rank == CUDA_PROCESS_BYTES
    assert sync.training == 8 * CUDA_PROCESS_BYTES
    assert staged.staged_per_rank == pytest.approx(3 * 68.98e9 * 4 / 16, rel=0.01)  # fp32 params + 2 moments / 16
    assert staged.training - sync.training == 8 * staged.staged_per_rank  # ~0.4 TB per node
    assert staged.training == pytest.approx(0.41e12 + 8 * CUDA_PROCESS_BYTES, rel=0.02)
    async_save = with_changes(seed_70b, "checkpoint.async_save=true")
    assert "async-save staging" in format_plan(make_plan(resolve(async_save, A100)))


def test_gpu_step_time_says_communication_is_assumed_hidden(seed_70b: JobSpec) -> None:
    plan = make_plan(resolve(seed_70b, A100))
    assert "communication assumed hidden behind compute" in plan.timing.throughput_note
    assert "communication assumed hidden" in format_plan(plan)


def test_offload_with_the_rank0_weight_load_is_refused_with_the_fix(seed_70b: JobSpec) -> None:
    """gpu-review #15: with CPU offload the shards are on the CPU, so rank 0's broadcast of the full weights goes
    over gloo: refused where it would take longer than the plan lets through, and never offered as a fix."""
    rank0 = with_changes(seed_70b, "resources.nodes=3 fsdp.cpu_offload=true env.FSDPJOB_WEIGHT_LOAD=rank0")
    plan = make_plan(resolve(rank0, A100))
    assert plan.fits and plan.verdict == "REFUSED"
    assert "FSDPJOB_WEIGHT_LOAD=rank0" in plan.refusal and "to each of 23 ranks" in plan.refusal
    assert "set fsdp.cpu_offload: false" in plan.refusal
    own = make_plan(resolve(with_changes(seed_70b, "resources.nodes=3 fsdp.cpu_offload=true"), A100))
    assert own.verdict == "FITS"  # each rank reads its own shards: no broadcast
    one = make_plan(resolve(with_changes(seed_70b, "resources.nodes=1 env.FSDPJOB_WEIGHT_LOAD=rank0"), A100))
    assert [f.change for f in one.fixes] == ["resources.nodes=3"]
    small = with_changes(rank0, "model.path=" + str(write_config(Path(seed_70b.model.path).parent / "small", {
        **LLAMA2_70B, "num_hidden_layers": 2, "hidden_size": 1024, "intermediate_size": 2048,
        "num_attention_heads": 8, "num_key_value_heads": 8})))  # fmt: skip
    assert make_plan(resolve(small, A100)).verdict == "FITS"  # a small model's broadcast takes seconds


def test_memory_tier_is_counted_per_node_and_a_plan_without_room_for_it_is_refused(seed_70b: JobSpec) -> None:
    """The tier holds each rank's saved state (fp32 params + 2 moments) in shared memory, the replica of a rank of
    the other node, and the files of the step it dropped last (the next snapshot fills them again): 4 x per node on
    2 nodes, and nothing of the state's size in the rank's process (a snapshot copies into the mapped files).
    For the 70B seed that is ~1.65 TB per node: it fits its 2,000 GiB nodes, also beside async_save's staging
    (another 0.4 TB), but not nodes of 1,536 GiB, where the plan without it fits: refused, and the plan names the
    tier."""
    plain = make_plan(resolve(seed_70b, A100))
    tiered = make_plan(resolve(with_changes(seed_70b, "checkpoint.memory_interval_steps=10"), A100))
    saved_per_rank = 3 * 68.98e9 * 4 / 16
    # (2 x 8 A100 does not fit the GPUs since budgets are usable memory: the host side is what is checked here)
    assert plain.host.memory_tier == 0 and plain.host.fits
    assert tiered.host.memory_tier == pytest.approx(8 * saved_per_rank * 4, rel=0.01)
    assert tier_rank_bytes(10 * GiB, multi_node=False) == 20 * GiB  # one node: no replica
    assert tiered.host.training - plain.host.training == tiered.host.memory_tier
    assert tiered.host.fits
    both = make_plan(resolve(with_changes(seed_70b, "checkpoint.memory_interval_steps=10 checkpoint.async_save=true"),
                             A100))
    assert both.host.fits
    smaller = A100.model_copy(update={"host_ram_gb": 1536.0})
    assert make_plan(resolve(seed_70b, smaller)).host.fits
    refused = make_plan(resolve(with_changes(seed_70b, "checkpoint.memory_interval_steps=10"), smaller))
    assert not refused.host.fits and not refused.fits
    assert "memory tier" in format_plan(refused)
    assert tiered.to_json()["host_memory"]["memory_tier_bytes"] == tiered.host.memory_tier
    assert "of it memory tier" in format_plan(tiered)


def test_a_profile_with_the_fabric_bandwidth_adds_the_collectives_time_to_a_multi_node_step(seed_70b: JobSpec) -> None:
    """Without fabric_bandwidth_gbps the step is compute and says communication is assumed hidden; with it, the
    collectives' bytes per node over the fabric give a time, and the step is the longer of the two."""
    from fsdpjob.orchestrator.planner.timing import COMMUNICATION, fabric_bytes

    spec = with_changes(seed_70b, "resources.nodes=3")
    plain = make_plan(resolve(spec, A100))
    assert plain.timing.comm_s is None and COMMUNICATION in plain.timing.throughput_note
    fast = make_plan(resolve(spec, A100.model_copy(update={"fabric_bandwidth_gbps": 200.0})))
    u = fast.setup
    assert u.nodes == 3 and u.replicate_degree == 1
    weights, trained = fast.trainable.weights, fast.trainable.trained
    gathers = (2 if u.reshard else 1) * weights * u.compute_bytes * u.grad_accum
    reduces = trained * 4 * (1 if u.defer_grad_sync else u.grad_accum)
    expected = (gathers + reduces) * (u.world - 1) / u.world
    assert fabric_bytes(u, weights, trained) == pytest.approx(expected, rel=1e-9)
    assert fast.timing.comm_s == pytest.approx(expected / 200e9, rel=1e-9)
    assert fast.timing.step_s == pytest.approx(max(fast.timing.compute_s, fast.timing.comm_s))
    assert "over the fabric at 200 GB/s per node" in fast.timing.throughput_note
    slow = make_plan(resolve(spec, A100.model_copy(update={"fabric_bandwidth_gbps": 0.5})))
    assert slow.timing.comm_s > slow.timing.compute_s and slow.timing.step_s == pytest.approx(slow.timing.comm_s)
    assert "the step is bound by the fabric" in format_plan(slow)
    assert slow.to_json()["step"]["communication_s"] == pytest.approx(slow.timing.comm_s)
    one = make_plan(resolve(with_changes(seed_70b, "resources.nodes=1 fsdp.cpu_offload=true"),
                            A100.model_copy(update={"fabric_bandwidth_gbps": 0.5})))
    assert one.timing.comm_s is None and "one node: collectives over NVLink" in one.timing.throughput_note


def test_packed_batches_take_varlen_attention_on_gpus_and_a_dense_mask_is_counted(seed_70b: JobSpec) -> None:
    """The default attention (auto) on a GPU with boundary-aware packing in bf16 is varlen (no mask); sdpa asked
    for by name builds a dense [B, 1, S, S] mask, which the plan counts (and warns about); naive packing or fp32
    compute keeps sdpa, which then needs no mask or cannot run the flash kernel."""
    spec = with_changes(seed_70b, "resources.nodes=3 data.seq_len=4096")
    auto = make_plan(resolve(spec, A100))
    assert spec.model.attn_implementation == "auto" and auto.setup.attn == "varlen" and not auto.setup.dense_mask
    sdpa = make_plan(resolve(with_changes(spec, "model.attn_implementation=sdpa"), A100))
    assert sdpa.setup.attn == "sdpa" and sdpa.setup.dense_mask
    # One layer's bias (bf16) kept while its recompute runs, plus the shared bool mask: at least S^2 x 3 bytes.
    assert sdpa.device.peak - auto.device.peak >= 4096**2 * 3
    assert any("dense 4096 x 4096 mask" in w for w in sdpa.warnings) and not any("mask" in w for w in auto.warnings)
    naive = make_plan(resolve(with_changes(spec, "data.packing=naive"), A100))
    assert naive.setup.attn == "sdpa" and not naive.setup.dense_mask
    fp32 = make_plan(resolve(with_changes(spec, "fsdp.mixed_precision=fp32"), A100))
    assert fp32.setup.attn == "sdpa"


def test_attention_rule_is_one_for_planner_and_worker() -> None:
    from fsdpjob.orchestrator.core.jobspec.families import attention_for, windowed

    gpu = {"on_gpu": True, "packed": True, "half": True}
    assert attention_for("llama", "auto", **gpu) == "varlen"
    assert attention_for("llama", "auto", **{**gpu, "on_gpu": False}) == "sdpa"  # CPU: no flash kernel to miss
    assert attention_for("llama", "auto", **gpu, windowed=True) == "sdpa"
    assert attention_for("gemma2", "auto", **gpu) == "eager"  # no sdpa path, soft-capping: neither varlen
    assert attention_for("llama", "sdpa", **gpu) == "sdpa" and attention_for("llama", "varlen") == "varlen"
    assert windowed({"sliding_window": 4096}) and not windowed({"sliding_window": 4096, "use_sliding_window": False})
    assert windowed({"layer_types": ["full_attention", "sliding_attention"]}) and not windowed({})


@pytest.mark.parametrize("gpu_type, bf16", [("H100-SXM5-80GB", 989e12), ("H100-PCIe-80GB", 756e12),
                                            ("H100-NVL-94GB", 835e12), ("H200-NVL-141GB", 835e12),
                                            ("H200-SXM-141GB", 989e12), ("H800-SXM-80GB", 989e12),
                                            ("A100-80GB", 312e12), ("GH200-480GB", 989e12)])
def test_the_planner_and_the_worker_read_one_peak_table(gpu_type: str, bf16: float) -> None:
    """A profile's gpu_type and torch's device name find the same row (core/flops.PEAK_FLOPS): a PCIe or NVL card
    is not planned at the SXM card's peak, and the worker's MFU uses the figure the plan did."""
    from fsdpjob.jobs.report.metrics import peak_flops_for_name
    from fsdpjob.orchestrator.core.flops import peak_flops

    assert peak_flops(gpu_type) == bf16 and peak_flops(gpu_type, 4) < bf16 / 10
    assert peak_flops_for_name("NVIDIA " + gpu_type.rsplit("-", 1)[0].replace("-", " ")) == bf16
    assert peak_flops("H1000") is None and peak_flops("fake (CPU compute; torch sees no CUDA)") is None


def test_dpo_counts_both_answers_rows_and_a_live_reference_copy_and_proposes_the_cache(seed_70b: JobSpec) -> None:
    """Preference training (issue 39): each pair is two rows in the forward; reference: live on a full fine-tune
    holds a frozen sharded copy of the weights; where that does not fit, the fix is reference: cached."""
    three = with_changes(seed_70b, "resources.nodes=3 data.seq_len=6144")
    sft = make_plan(resolve(three, A100))
    dpo = "train.method=dpo data.packing=false data.prompt_field=prompt"
    cached = make_plan(resolve(with_changes(three, dpo), A100))
    live = make_plan(resolve(with_changes(three, f"{dpo} dpo.reference=live"), A100))
    assert cached.device.peak > sft.device.peak  # twice the rows' activations and logits
    copy = next(i for i in live.device.state if i.name == "reference model (live)")
    assert copy.bytes == -(-live.trainable.weights // 24) * 4 and copy.bytes > 10 * GiB  # 70B fp32 over 24 ranks
    assert not live.fits and cached.fits
    assert live.fixes[0].change == "dpo.reference=cached", live.fixes
    assert live.timing.flops_per_rank > cached.timing.flops_per_rank  # the reference's forward every step
    lora = make_plan(resolve(with_changes(three, f"{dpo} dpo.reference=live model.lora={{}}"), A100))
    assert not [i for i in lora.device.state if i.name == "reference model (live)" and i.bytes]  # adapters off
