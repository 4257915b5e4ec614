"""A LoRA run's reference is the base: the same model with peft's adapters off. modules_to_save (a trained copy
of lm_head, say) is no tuner layer: left on, the "reference" of `reference: live`, GRPO's KL term and a cache
recomputed after step 0 drifted with training (logits 1.66 away from the base in the review's check)."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import torch
from families import tiny_config

from fsdpjob.jobs.model.lora import attach_lora
from fsdpjob.jobs.preference.reference import as_reference


def test_the_reference_switches_modules_to_save_off_as_well():
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(tiny_config("llama"))
    model = copy.deepcopy(base)
    lora = SimpleNamespace(r=4, alpha=8, dropout=0.0, target_modules=["q_proj", "v_proj"], modules_to_save=["lm_head"])
    attach_lora(model, lora, draw_initial=False)  # on real weights: the copy starts as the base
    with torch.no_grad():  # "training": every trainable weight moved, the adapters and the saved lm_head copy
        for p in model.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.5)
    ids = torch.randint(0, base.config.vocab_size, (2, 9))
    want = base(ids).logits
    trained = model(ids).logits
    assert (trained - want).abs().max() > 0.1  # the trained model differs from the base
    with as_reference(model, lora=True):
        reference = model(ids).logits
    torch.testing.assert_close(reference, want, rtol=1e-5, atol=1e-5)
    # and back on: the trained model, and peft's requires_grad as it set it
    torch.testing.assert_close(model(ids).logits, trained)
    assert any(p.requires_grad for n, p in model.named_parameters() if "modules_to_save" in n)
    assert not any(p.requires_grad for n, p in model.named_parameters() if "original_module" in n)
