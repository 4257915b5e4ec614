"""LoRA on the login node: the spec's model.lora (errors at FILE:LINE, the hash unchanged without it, the resume
fingerprint), and the planner (adapter counts equal to what peft injects, frozen weights without gradients or
AdamW, the Llama-2-70B seed on one node, the checkpoint size and save time that follow)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from fsdpjob.orchestrator.core.jobspec.profiles import load_profile
from fsdpjob.orchestrator.core.jobspec.spec import JobSpec, load_spec
from fsdpjob.orchestrator.core.jobspec.validation import SpecErrors
from fsdpjob.orchestrator.core.units import GiB
from fsdpjob.orchestrator.planner.fit import make_plan
from fsdpjob.orchestrator.planner.lora import lora_training
from fsdpjob.orchestrator.planner.modelshape import count_params, read_model_shape
from fsdpjob.orchestrator.planner.resolve import resolve
from fsdpjob.orchestrator.views.plan import format_plan

BASE = "name: unit\nmodel:\n  path: /m\n{lora}data:\n  path: /d.jsonl\ntrain:\n  max_steps: 10\n"
LLAMA2_70B = {
    "model_type": "llama", "vocab_size": 32000, "hidden_size": 8192, "intermediate_size": 28672,
    "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8, "tie_word_embeddings": False,
    "torch_dtype": "float16",
}  # fmt: skip
A100 = load_profile("a100-80gb")


def spec_errors(tmp_path: Path, lora: str) -> list[str]:
    path = tmp_path / "job.yaml"
    path.write_text(BASE.format(lora=lora))
    with pytest.raises(SpecErrors) as info:
        load_spec(path)
    return [e.format() for e in info.value.errors]


# --- spec ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("lora, line, field, words", [
    ("  lora:\n    r: 0\n", 5, "model.lora.r", "greater than 0"),
    ("  lora:\n    target_modules: [q_proj, q_proj]\n", 5, "model.lora.target_modules", "listed twice"),
    ("  lora:\n    target_modules: 'q_proj; rm'\n", 5, "model.lora.target_modules", "all-linear"),
    ("  lora:\n    modules_to_save: ['embed tokens']\n", 5, "model.lora.modules_to_save", "not module names"),
    ("  lora:\n    dropout: 1.0\n", 5, "model.lora.dropout", "less than 1"),
    ("  lora:\n    rank: 8\n", 5, "model.lora.rank", "valid keys: r, alpha, dropout"),
    ("  lora:\n    alpah: 8\n", 5, "model.lora.alpah", "did you mean 'alpha'?"),
])  # fmt: skip
def test_lora_errors_name_the_field_and_its_line(tmp_path, lora, line, field, words):
    (error,) = spec_errors(tmp_path, lora)
    assert error.startswith(f"{tmp_path / 'job.yaml'}:{line}: {field}: ") and words in error, error


def test_lora_counts_in_the_hash_and_fingerprint_only_when_set(tmp_path):
    spec = JobSpec.model_validate({"name": "unit", "model": {"path": "/m"}, "data": {"path": "/d.jsonl"},
                                   "train": {"max_steps": 10}})
    assert spec.spec_hash() == "3ae83287ef4c4c1f"  # this spec's hash before model.lora existed (commit 8ae5fd4)
    assert "model.lora" not in spec.model_fingerprint()
    lora = JobSpec.model_validate({**spec.model_dump(mode="json"), "model": {"path": "/m", "lora": {"r": 8}}})
    assert lora.spec_hash() != spec.spec_hash()
    # The spec's fingerprint says auto; the checkpoint's (jobs/model/lora.checkpoint_fingerprint) resolves it by the
    # family: all-linear on this dense model, as checkpoints recorded before auto became the default.
    assert lora.model_fingerprint()["model.lora"] == {"r": 8, "alpha": 32.0, "dropout": 0.0,
                                                       "target_modules": "auto", "modules_to_save": []}
    written = JobSpec.model_validate({**spec.model_dump(mode="json"),
                                      "model": {"path": "/m", "lora": {"r": 8, "target_modules": "all-linear"}}})
    assert written.spec_hash() == lora.spec_hash()  # auto hashes as the all-linear it was before


# --- planner -------------------------------------------------------------------------------------------------


def _plan(tmp_path: Path, **sections):
    folder = tmp_path / "llama-2-70b"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(LLAMA2_70B))
    data = {"name": "lora-plan", "model": {"path": str(folder), "activation_checkpointing": True},
            "data": {"path": "train.jsonl", "seq_len": 2048}, "train": {"max_steps": 500}}
    for key, value in sections.items():
        data[key] = {**data.get(key, {}), **value}
    return make_plan(resolve(JobSpec.model_validate(data), A100))


def test_seed_70b_with_lora_fits_on_one_node_and_checkpoints_the_adapters_only(tmp_path):
    full = _plan(tmp_path, resources={"nodes": 1})
    lora = _plan(tmp_path, resources={"nodes": 1}, model={"lora": {"r": 16}})
    assert not full.fits and lora.fits
    adapters = 80 * 16 * (2 * (8192 + 8192) + 2 * (8192 + 1024) + 3 * (8192 + 28672))  # q, o; k, v; gate, up, down
    assert lora.trainable.trained == adapters == 207_093_760
    items = {i.name: i.bytes for i in lora.device.breakdown}
    assert items["parameters"] == pytest.approx((68_976_648_192 + adapters) * 4 / 8, abs=8)  # frozen base: weights
    assert items["AdamW state"] == pytest.approx(2 * adapters * 4 / 8, abs=8)  # AdamW for the adapters only
    assert "lm_head gradient" not in items and "gradients" not in items  # no grads at the peak moment
    assert lora.device.peak < 50 * GiB
    assert lora.timing.checkpoint_bytes == adapters * 4 * 3  # 2.5 GB instead of 828 GB
    assert lora.timing.save_s == pytest.approx(lora.timing.checkpoint_bytes / 2.0e9)  # 1 node, 2 GB/s
    assert lora.timing.save_s < full.timing.save_s / 300
    # The backward computes no weight gradients for the frozen base: about 2/3 of a full step's FLOPs (AC: 6/8).
    assert lora.timing.flops_per_rank / full.timing.flops_per_rank == pytest.approx(6 / 8, rel=0.02)
    out = lora.to_json()
    assert out["params"]["trainable"] == adapters and out["params"]["added"] == adapters
    assert full.to_json()["params"]["trainable"] == 68_976_648_192 and full.to_json()["params"]["added"] == 0
    text = format_plan(lora)
    assert "LoRA: r=16 on all-linear (auto): 207 M params train" in text and "(adapters + AdamW)" in text


def test_lora_on_four_gpus_and_a_bf16_base_on_two(tmp_path):
    four = _plan(tmp_path, resources={"gpus_per_node": 4}, model={"lora": {}})
    two = _plan(tmp_path, resources={"gpus_per_node": 2}, model={"lora": {}})
    two_bf16 = _plan(tmp_path, resources={"gpus_per_node": 2}, model={"lora": {}, "dtype": "bfloat16"})
    assert four.fits and not two.fits and two_bf16.fits


def test_modules_to_save_train_in_full_with_their_gradients(tmp_path):
    plan = _plan(tmp_path, resources={"nodes": 1}, model={"lora": {"modules_to_save": ["embed_tokens", "lm_head"]}})
    tr = plan.trainable
    assert tr.trained == 207_093_760 + 2 * 32000 * 8192 and tr.head_trained
    assert tr.weights == 68_976_648_192 + tr.trained  # peft keeps the frozen originals next to the trained copies
    moments = {m.name: {i.name: i.bytes for i in m.items} for m in plan.device.moments}
    assert moments["backward, last layer"]["lm_head gradient"] == 32000 * 8192 * 2


def test_unknown_target_names_are_estimated_with_a_warning(tmp_path):
    plan = _plan(tmp_path, resources={"nodes": 1}, model={"lora": {"target_modules": ["q_proj", "my_adapter"]}})
    assert plan.trainable.trained == 80 * 16 * ((8192 + 8192) + (8192 + 8192))
    assert any("my_adapter" in w and "hidden x hidden" in w for w in plan.warnings)


DENSE = ("llama", "qwen2", "qwen3", "mistral", "gemma", "gemma2", "phi", "phi3", "olmo", "olmo2", "stablelm",
         "granite", "gpt2", "gpt_neox", "falcon", "starcoder2", "glm", "glm4", "cohere", "smollm3")


@pytest.mark.parametrize("family", DENSE)
@pytest.mark.parametrize("targets", ["all-linear", "attention"])
def test_planned_adapter_count_is_what_peft_injects(tmp_path, family, targets):
    """The planner's count (config.json only) against the worker's injection on the meta device."""
    import torch
    from families import tiny_config
    from transformers import AutoModelForCausalLM

    from fsdpjob.jobs.model.lora import attach_lora

    config = tiny_config(family)
    names = {"gpt2": ["c_attn"], "gpt_neox": ["query_key_value"], "falcon": ["query_key_value"],
             "phi3": ["qkv_proj"]}.get(family, ["q_proj", "v_proj"])  # fmt: skip
    lora = SimpleNamespace(r=4, alpha=8, dropout=0.0, target_modules="all-linear" if targets == "all-linear" else names,
                           modules_to_save=[])
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    attach_lora(model, lora, draw_initial=False)
    injected = sum(p.numel() for p in model.parameters() if p.requires_grad)
    config.save_pretrained(tmp_path)
    shape = read_model_shape(tmp_path)
    assert lora_training(shape, count_params(shape), lora).trained == injected


def test_target_names_the_model_lacks_are_refused_at_validate(tmp_path):
    """peft would refuse them on the workers, after the queue: validate names them and the valid ones."""
    from helpers import fsdpjob
    from specs import llama2_70b_spec

    spec = llama2_70b_spec(tmp_path, 1)
    targets = "    target_modules: [q_proj, qkv, self_attn.v_proj]"
    text = spec.read_text().replace("model:\n", f"model:\n  lora:\n{targets}\n")
    spec.write_text(text)
    line = text.splitlines().index(targets) + 1
    done = fsdpjob("validate", str(spec))
    assert done.returncode == 2 and len(done.stderr.splitlines()) == 1, done.stderr
    assert done.stderr.startswith(f"{spec}:{line}: model.lora.target_modules: qkv: no such linear layer in a llama "
                                  "model; name some of q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj, "
                                  "embed_tokens, lm_head, or write all-linear"), done.stderr
    assert fsdpjob("validate", str(spec), "--no-file-checks").returncode == 0  # the model folder is not read


@pytest.mark.parametrize("family", DENSE)
def test_every_target_name_validate_takes_is_a_module_of_the_family(tmp_path, family):
    import torch
    from families import tiny_config
    from transformers import AutoModelForCausalLM

    from fsdpjob.orchestrator.planner.lora import target_problem

    config = tiny_config(family)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    from transformers.pytorch_utils import Conv1D  # gpt2's linear layers, which peft adapts too

    kinds = (torch.nn.Linear, torch.nn.Embedding, Conv1D)
    names = {n.rpartition(".")[2] for n, m in model.named_modules() if isinstance(m, kinds)}
    config.save_pretrained(tmp_path)
    said = target_problem(read_model_shape(tmp_path), SimpleNamespace(target_modules=["no_such"]))
    valid = said.partition("name some of ")[2].removesuffix(", or write all-linear").split(", ")
    assert set(valid) <= names, set(valid) - names
