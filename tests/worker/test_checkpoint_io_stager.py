"""The async-save stager (jobs/checkpoint/staging.py) copes with the torch it runs on."""

from __future__ import annotations

import torch

from fsdpjob.jobs.checkpoint.staging import stage_in_background


def test_a_class_in_the_state_survives_a_stager_whose_deepcopy_table_lacks_classes():
    """torch 2.11's DCP stager has no entry for classes in its deepcopy table: the second async save of a real run
    on an H200 failed with KeyError: <class 'type'>, and its copiers are called with non_blocking=. This torch's
    table is made to look like 2.11's; the state still stages, the class as itself and the tensor as a copy."""
    stager = stage_in_background(cuda=False)
    try:
        table = stager._state_dict_stager._deepcopy_dispatch
        table.pop(type, None)
        state = {"weight": torch.arange(4.0), "kind": torch.nn.Linear, "nested": {"cls": torch.optim.AdamW}}
        staged = stager.stage(state)
        staged = staged.result() if hasattr(staged, "result") else staged
        assert staged["kind"] is torch.nn.Linear and staged["nested"]["cls"] is torch.optim.AdamW
        assert torch.equal(staged["weight"], state["weight"]) and staged["weight"] is not state["weight"]
        assert table[type](torch.nn.Linear, {}, non_blocking=True) is torch.nn.Linear
    finally:
        stager.close()
