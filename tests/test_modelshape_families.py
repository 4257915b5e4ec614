"""The planner's model shape for every family the worker trains: the exact parameter count from the
safetensors headers, the same count from config.json alone, a stated estimate for an unknown family,
and `fsdpjob plan` before the download (config.json only) while `validate` still wants the files."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import helpers
import pytest
from families import FAMILIES, PLANNED_FAMILIES, save_tiny_family, tiny_config

from fsdpjob.orchestrator.core.jobspec.families import SUPPORTED_MODEL_TYPES
from fsdpjob.orchestrator.planner.modelshape import (
    EXACT_FROM_CONFIG,
    count_params,
    read_model_shape,
    read_safetensors_header,
)


def _exact(model) -> int:
    return sum(p.numel() for p in model.parameters())  # tied parameters once


@pytest.mark.parametrize("family", FAMILIES)
def test_count_from_the_safetensors_headers_is_exact(tmp_path: Path, family: str) -> None:
    model = save_tiny_family(tmp_path, family)
    shape = read_model_shape(tmp_path)
    assert shape.counted is not None and shape.estimate is None
    counted = count_params(shape)
    assert counted.total == _exact(model)
    assert counted.layers == 2 and counted.per_layer > 0


@pytest.mark.parametrize("family", PLANNED_FAMILIES)
def test_count_from_config_json_alone_is_exact(tmp_path: Path, family: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    assert family in EXACT_FROM_CONFIG and family in SUPPORTED_MODEL_TYPES
    config = tiny_config(family)
    config.save_pretrained(tmp_path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    shape = read_model_shape(tmp_path)
    assert shape.counted is None and shape.estimate is None
    assert count_params(shape).total == _exact(model)


def test_sharded_checkpoint_headers_are_summed_and_tied_weights_count_once(tmp_path: Path) -> None:
    model = save_tiny_family(tmp_path, "llama", tie_word_embeddings=True)
    model.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    counted = count_params(read_model_shape(tmp_path / "sharded"))
    assert counted.total == _exact(model) and counted.lm_head == 0


def test_header_reader_needs_no_torch(tmp_path: Path) -> None:
    header = json.dumps({"w": {"dtype": "BF16", "shape": [3, 5], "data_offsets": [0, 30]}}).encode()
    (tmp_path / "x.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 30)
    assert read_safetensors_header(tmp_path / "x.safetensors")["w"]["shape"] == [3, 5]


def test_an_unknown_family_gets_a_stated_estimate_not_a_refusal(tmp_path: Path) -> None:
    config = {"model_type": "brand_new", "vocab_size": 1000, "hidden_size": 64, "num_hidden_layers": 3,
              "num_attention_heads": 4}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    shape = read_model_shape(tmp_path)
    assert shape.estimate and "12 x layers x hidden^2" in shape.estimate and "'brand_new'" in shape.estimate
    assert count_params(shape).total == 12 * 3 * 64 * 64 + 2 * 1000 * 64


SPEC = """name: early
profile: local
model:
  path: {model}
data:
  path: data.jsonl
train:
  max_steps: 3
"""


def test_plan_needs_only_config_json_and_validate_still_wants_the_files(tmp_path: Path) -> None:
    config = tiny_config("gpt2")
    config.architectures = ["GPT2LMHeadModel"]  # its causal LM's name has no ForCausalLM
    config.save_pretrained(tmp_path / "model")  # config.json only: before the download
    (tmp_path / "data.jsonl").write_text('{"text": "hello"}\n')
    (tmp_path / "spec.yaml").write_text(SPEC.format(model="model"))
    done = helpers.fsdpjob("plan", str(tmp_path / "spec.yaml"), check=True)
    assert "plan for early: gpt2" in done.stdout
    done = helpers.fsdpjob("validate", str(tmp_path / "spec.yaml"))
    assert done.returncode == 2 and done.stdout == ""
    line = done.stderr.strip()
    assert line.startswith(f"{tmp_path / 'spec.yaml'}:4: model.path: no weights in "), line
    assert "safetensors" in line


def test_buffers_stored_by_older_checkpoints_are_not_parameters(tmp_path: Path) -> None:
    tensors = {"wte.weight": [256, 32], "ln_f.weight": [32], "ln_f.bias": [32]}
    for i in range(2):
        tensors |= {f"h.{i}.attn.bias": [1, 1, 64, 64], f"h.{i}.attn.masked_bias": [],
                    f"h.{i}.attn.c_attn.weight": [32, 96], f"h.{i}.attn.c_attn.bias": [96]}  # fmt: skip
    header = json.dumps({k: {"dtype": "F32", "shape": v, "data_offsets": [0, 0]} for k, v in tensors.items()}).encode()
    tiny_config("gpt2").save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
    counted = count_params(read_model_shape(tmp_path))
    assert counted.total == 256 * 32 + 2 * 32 + 2 * (32 * 96 + 96)
    assert counted.embedding == 256 * 32 and counted.lm_head == 0


def test_every_family_can_run_the_default_attention() -> None:
    """The spec's default attention (sdpa) falls back to eager exactly where transformers has no sdpa path:
    otherwise the workers would fail at the first forward, after the queue wait (gemma2 on transformers 5.x)."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from fsdpjob.orchestrator.core.jobspec.families import attention_for
    from fsdpjob.orchestrator.core.jobspec.spec import ModelSpec

    default = ModelSpec.model_fields["attn_implementation"].default
    for family in SUPPORTED_MODEL_TYPES:
        model_class = getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[family])
        chosen = attention_for(family, default)
        assert chosen == ("sdpa" if model_class._supports_sdpa else "eager"), family
        assert attention_for(family, "flash_attention_2") == "flash_attention_2"


def test_plan_counts_and_names_the_attention_the_worker_runs(tmp_path: Path) -> None:
    tiny_config("gemma2").save_pretrained(tmp_path / "model")
    (tmp_path / "spec.yaml").write_text(SPEC.format(model="model"))
    seq = ("--set", "data.seq_len=64")  # the tiny config's max_position_embeddings
    plan = json.loads(helpers.fsdpjob("plan", str(tmp_path / "spec.yaml"), "--json", *seq, check=True).stdout)
    assert any("gemma2 has no sdpa attention in transformers: it trains with eager" in w for w in plan["warnings"])
    eager = json.loads(helpers.fsdpjob("plan", str(tmp_path / "spec.yaml"), "--json", *seq, "--set",
                                       "model.attn_implementation=eager", check=True).stdout)
    assert plan["device_memory"]["peak_bytes"] == eager["device_memory"]["peak_bytes"]  # eager's scores counted
