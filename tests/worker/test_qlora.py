"""QLoRA end to end on 2 real gloo ranks (jobs.train.run, spec model.quantize: nf4): the frozen base's decoder linears
are torchao NF4 tensors sharded by FSDP2, the loss falls with only the adapters training, the checkpoint holds only
the adapters, a stop at step k and a resume give bitwise the adapters of an uninterrupted run, and the export loads
with peft while the merged bf16 model gives the trained (4-bit base) model's logits."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from distributed import (
    committed_model_state,
    logged_losses,
    run_ranks,
    train_worker,
    trained_logits,
    uninterrupted_and_resumed,
    write_run,
)

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
pytest.importorskip("torchao")

STEPS, STOP_AT = 6, 3
LORA = {"r": 4, "alpha": 8}


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> dict:
    from fsdpjob.jobs.quickstart import make_quickstart

    return make_quickstart(tmp_path_factory.mktemp("assets"))


def make_run(root: Path, name: str, assets: dict, *, export_final: bool = False) -> Path:
    return write_run(root, name, {
        "model": {"path": assets["model_path"], "lora": LORA, "quantize": "nf4", "activation_checkpointing": True},
        "data": {"path": assets["data_path"], "seq_len": 32},
        "train": {"max_steps": STEPS, "grad_accum_steps": 2, "lr": 1e-2, "log_every": 1},
        "fsdp": {"mixed_precision": "fp32"},
        "checkpoint": {"interval_steps": 0, "interval_minutes": 0, "export_final": export_final},
    })


def train(run_dir: Path, world: int = 2, **env: str) -> list[int]:
    return run_ranks(train_worker, world, run_dir=str(run_dir), env=env)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, assets) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("runs")
    return uninterrupted_and_resumed(lambda name: make_run(root, name, assets), train, STOP_AT)


def test_loss_falls_and_only_the_adapters_are_checkpointed(runs):
    loss = logged_losses(runs["full"])
    assert set(loss) == set(range(1, STEPS + 1)) and loss[STEPS] < loss[1] - 0.3, loss
    saved = committed_model_state(runs["full"])
    assert saved and all(".lora_" in k for k in saved), sorted(saved)[:5]
    step = (runs["full"] / "checkpoints" / (runs["full"] / "checkpoints" / "latest").read_text().strip())
    assert json.loads((step / "fsdpjob.json").read_text())["fingerprint"]["model.quantize"] == "nf4"


def test_stop_and_resume_gives_bitwise_the_uninterrupted_adapters(runs):
    events = [json.loads(x) for x in (runs["stopped"] / "events.jsonl").read_text().splitlines()]
    assert [e["step"] for e in events if e["event"] == "resume"] == [STOP_AT]
    full, same = logged_losses(runs["full"]), logged_losses(runs["stopped"])
    assert all(full[s] == same[s] for s in range(1, STEPS + 1)), (full, same)
    a, b = committed_model_state(runs["full"]), committed_model_state(runs["stopped"])
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)


def test_a_stop_on_2_ranks_resumes_on_1_within_fp32_tolerance(runs, assets, tmp_path):
    """The 4-bit base is the same on any world size (quantized whole, then cut): the adapters resume on 1 rank
    (global batch 4: 1 x 2 x 2 ranks, then 1 x 4 x 1) to the uninterrupted run's losses and adapters."""
    import torch

    moved = make_run(tmp_path, "moved", assets)
    assert train(moved, FSDPJOB_STOP_AT_STEP=str(STOP_AT)) == [0, 0]
    assert train(moved, world=1) == [0]
    full, other = logged_losses(runs["full"]), logged_losses(moved)
    for step in range(STOP_AT + 1, STEPS + 1):
        assert other[step] == pytest.approx(full[step], rel=1e-5), (step, other[step], full[step])
    a, b = committed_model_state(runs["full"]), committed_model_state(moved)
    assert a.keys() == b.keys() and all(torch.allclose(a[k], b[k], rtol=1e-4, atol=1e-6) for k in a)


def _quantized_logits(rank: int, world_size: int, run_dir: str, input_ids) -> object:
    """The trained model's logits, after checking that its base linears are NF4 (q, k, v, o, gate, up, down)."""
    from fsdpjob.jobs.model.quantize import is_quantized

    layers = json.loads((Path(json.loads((Path(run_dir) / "spec.json").read_text())["spec"]["model"]["path"])
                         / "config.json").read_text())["num_hidden_layers"]
    return trained_logits(rank, world_size, run_dir, input_ids,
                          check=lambda model: sum(is_quantized(p) for p in model.parameters()) == layers * 7)


def test_export_loads_with_peft_and_the_merged_model_gives_the_trained_logits(runs, assets, tmp_path):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from fsdpjob.jobs.export import export_from_path

    vocab = json.loads((Path(assets["model_path"]) / "config.json").read_text())["vocab_size"]
    input_ids = torch.randint(3, vocab, (2, 24), generator=torch.Generator().manual_seed(0))
    trained = torch.from_numpy(run_ranks(_quantized_logits, 2, run_dir=str(runs["full"]), input_ids=input_ids)[0])
    export_from_path(runs["full"], tmp_path / "adapter", "fp32")
    export_from_path(runs["full"], tmp_path / "merged", "bf16", merge=True)
    export_from_path(runs["full"], tmp_path / "merged32", "fp32", merge=True)
    base = AutoModelForCausalLM.from_pretrained(assets["model_path"], dtype=torch.float32)
    with torch.no_grad():
        plain = base(input_ids=input_ids).logits
        adapted = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()(input_ids=input_ids).logits
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged32", dtype=torch.float32)
        merged_logits = merged(input_ids=input_ids).logits
        bf16 = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
        assert bf16.dtype == torch.bfloat16
        bf16_logits = bf16(input_ids=input_ids).logits.float()
    assert (trained - plain).abs().max() > 1e-2  # the adapters changed the model
    assert (adapted - plain).abs().max() > 1e-2  # peft applied the exported adapters (to the full-precision base)
    torch.testing.assert_close(merged_logits, trained, rtol=1e-4, atol=1e-4)  # merged into the 4-bit base's weights
    assert (bf16_logits - trained).abs().max() < 0.1


def test_resume_across_a_quantize_change_is_refused(runs, tmp_path):
    run_dir = tmp_path / "changed"
    shutil.copytree(runs["full"], run_dir)
    meta = json.loads((run_dir / "spec.json").read_text())
    meta["spec"]["model"]["quantize"] = None
    meta["spec"]["train"]["max_steps"] = STEPS + 1
    (run_dir / "spec.json").write_text(json.dumps(meta))
    with pytest.raises(AssertionError, match=r"refusing to resume .*model\.quantize"):
        train(run_dir)
