"""jobs/model/router.py on one process: the tap's load-balancing loss is transformers' own, only armed forwards
record, and the metrics read the tokens each expert received."""

from __future__ import annotations

import torch
from families import VOCAB, tiny_config


def _model(family: str):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_config(family))


def test_aux_loss_is_transformers_own_and_only_armed_forwards_record():
    from fsdpjob.jobs.model.router import aux_term, router_tap

    model = _model("mixtral")
    tap = router_tap(model)
    assert tap is not None and len(tap.routers) == 2 and tap.coef == model.config.router_aux_loss_coef
    ids = torch.randint(3, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
    tap.arm()
    out = model(input_ids=ids, labels=ids)
    aux = tap.collect()
    torch.testing.assert_close(aux, out.aux_loss)
    model(input_ids=ids)  # not armed: nothing recorded
    assert aux_term(tap, 2) == 0.0  # nothing since the last collect
    metrics = tap.read()
    assert tap.counts is None and set(metrics) == {"moe_aux_loss", "moe_imbalance_max", "moe_imbalance_l0",
                                                   "moe_imbalance_l1"}
    assert metrics["moe_aux_loss"] == aux.item()
    assert 1.0 <= metrics["moe_imbalance_l0"] <= 2.0


def test_dense_models_have_no_tap_and_deepseek_trains_no_aux_loss():
    from fsdpjob.jobs.model.router import router_tap

    assert router_tap(_model("llama")) is None
    tap = router_tap(_model("deepseek_v3"))
    assert tap is not None and len(tap.routers) == 1 and tap.coef == 0.0  # one dense layer, one routed
