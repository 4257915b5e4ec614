"""LoRA's default targets on mixture-of-experts families (model.lora.target_modules: auto, issue 56): the attention's
linear layers only, as the family table says, with the router and the experts frozen; all-linear or named modules
adapt more on request; dense families keep all-linear; the planner counts what the workers adapt."""

from __future__ import annotations

import pytest
from families import MOE_FAMILIES, tiny_config

from fsdpjob.orchestrator.core.jobspec.families import FAMILIES, lora_targets
from fsdpjob.orchestrator.core.jobspec.modelspec import LoraSpec


def _adapted(family: str, targets: str | list[str] = "auto") -> set[str]:
    """The last names of the modules peft wraps in a tiny ``family`` model on the meta device."""
    import torch
    from peft.tuners.lora import LoraLayer
    from transformers import AutoModelForCausalLM

    from fsdpjob.jobs.model.lora import attach_lora

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(tiny_config(family))
    attach_lora(model, LoraSpec(r=4, target_modules=targets), draw_initial=False)
    return {name.rpartition(".")[2] for name, m in model.named_modules() if isinstance(m, LoraLayer)}


def test_auto_is_all_linear_on_dense_families_and_attention_on_moe() -> None:
    assert LoraSpec().target_modules == "auto"
    assert lora_targets("llama", "auto") == "all-linear" and lora_targets("unknown_family", "auto") == "all-linear"
    assert lora_targets("mixtral", "auto") == ["q_proj", "k_proj", "v_proj", "o_proj"]
    assert lora_targets("mixtral", ["gate"]) == ["gate"]  # named modules stay as written
    assert all(FAMILIES[f].moe and "gate" not in lora_targets(f, "auto") for f in MOE_FAMILIES)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_moe_default_adapts_attention_only_and_all_linear_more(family: str) -> None:
    default = _adapted(family)
    assert default and default <= set(FAMILIES[family].lora_attention), default
    assert not default & {"gate", "router", "gate_proj", "up_proj", "down_proj", "experts"}
    every = _adapted(family, "all-linear")  # the router and a shared expert on request, where they are linears
    # (gpt-oss keeps its router and experts as tensors of their own: all-linear is the attention there too)
    assert every > default if FAMILIES[family].lora_linears != FAMILIES[family].lora_attention else every == default


def test_the_plan_counts_the_attention_adapters_on_moe(tmp_path) -> None:
    import json

    from fsdpjob.orchestrator.planner.lora import trainable
    from fsdpjob.orchestrator.planner.modelshape import count_params, read_model_shape

    (tmp_path / "config.json").write_text(json.dumps(tiny_config("qwen3_moe").to_dict()))
    shape = read_model_shape(tmp_path)
    auto = trainable(shape, count_params(shape), LoraSpec(r=4))
    named = trainable(shape, count_params(shape), LoraSpec(r=4, target_modules=["q_proj", "k_proj", "v_proj",
                                                                                 "o_proj"]))
    assert auto.trained == named.trained and auto.note is None  # exact: no expert is adapted
