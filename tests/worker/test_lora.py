"""LoRA end to end on real gloo ranks (jobs.train.run): the loss falls with only the adapters training; 1 and 2
ranks train the same steps; a stop at step k and a resume give bitwise the adapters of an uninterrupted run, and a
resume on 1 rank the same within fp32 tolerance; the checkpoint holds only what trains; the export loads with peft
(and merged, with transformers) and gives the trained model's logits; a resume against another base is refused."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from distributed import committed_model_state, logged_losses, run_ranks, train_worker, trained_logits, write_run

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

STEPS, STOP_AT = 8, 4
LORA = {"r": 4, "alpha": 8, "modules_to_save": ["embed_tokens"]}


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> dict:
    from fsdpjob.jobs.quickstart import make_quickstart

    return make_quickstart(tmp_path_factory.mktemp("assets"))


def make_run(root: Path, name: str, model_path: str, data_path: str, *, grad_accum: int, steps: int = STEPS,
             export_final: bool = False) -> Path:
    return write_run(root, name, {
        "model": {"path": model_path, "lora": LORA, "activation_checkpointing": True},
        "data": {"path": data_path, "seq_len": 32},
        # Global batch 4: 1 x 2 x 2 ranks, or 1 x 4 x 1 rank.
        "train": {"max_steps": steps, "grad_accum_steps": grad_accum, "lr": 1e-2, "log_every": 1},
        "fsdp": {"mixed_precision": "fp32"},
        "checkpoint": {"interval_steps": 0, "interval_minutes": 0, "export_final": export_final},
    })


losses = logged_losses


def train(run_dir: Path, world: int, **env: str) -> list[int]:
    return run_ranks(train_worker, world, run_dir=str(run_dir), env=env)


def latest_step_dir(run_dir: Path) -> Path:
    root = run_dir / "checkpoints"
    return root / (root / "latest").read_text().strip()


@pytest.fixture(scope="module")
def runs(tmp_path_factory, assets) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("runs")
    model, data = assets["model_path"], assets["data_path"]
    two = make_run(root, "two", model, data, grad_accum=2, export_final=True)
    assert train(two, 2) == [0, 0]
    one = make_run(root, "one", model, data, grad_accum=4)
    assert train(one, 1) == [0]
    stopped = make_run(root, "stopped", model, data, grad_accum=2)
    assert train(stopped, 2, FSDPJOB_STOP_AT_STEP=str(STOP_AT)) == [0, 0]
    on1 = root / "resumed-on-1"
    shutil.copytree(stopped, on1)
    assert train(stopped, 2) == [0, 0]
    assert train(on1, 1) == [0]
    return {"two": two, "one": one, "same": stopped, "on1": on1}


def test_loss_falls_and_only_the_adapters_are_checkpointed(runs):
    from torch.distributed.checkpoint import FileSystemReader

    loss = losses(runs["two"])
    assert loss[STEPS] < loss[1] - 0.3, loss
    saved = committed_model_state(runs["two"])
    assert saved and all(".lora_" in k or ".modules_to_save." in k for k in saved), sorted(saved)[:5]
    assert any(".lora_A.default" in k for k in saved) and "model.embed_tokens.modules_to_save.default.weight" in saved
    # Optimizer state only for what trains: AdamW's moments per trained tensor, none for the frozen base.
    keys = FileSystemReader(str(latest_step_dir(runs["two"]))).read_metadata().state_dict_metadata
    moments = [k for k in keys if k.startswith("model.optim.state.") and k.endswith(".exp_avg")]
    assert len(moments) == len(saved)
    sidecar = json.loads((latest_step_dir(runs["two"]) / "fsdpjob.json").read_text())
    assert sidecar["fingerprint"]["model.lora"]["r"] == 4
    assert sidecar["fingerprint"]["model.path contents"].startswith("sha256:")


def test_one_and_two_ranks_train_the_same_steps(runs):
    one, two = losses(runs["one"]), losses(runs["two"])
    assert set(one) == set(two) == set(range(1, STEPS + 1))
    for step in one:
        assert abs(one[step] - two[step]) <= 1e-5 * abs(two[step]), (step, one[step], two[step])


def test_stop_and_resume_gives_bitwise_the_uninterrupted_adapters(runs):
    events = [json.loads(x) for x in (runs["same"] / "events.jsonl").read_text().splitlines()]
    assert [e["step"] for e in events if e["event"] == "resume"] == [STOP_AT]
    full, same = losses(runs["two"]), losses(runs["same"])
    assert all(full[s] == same[s] for s in range(1, STEPS + 1)), (full, same)
    a, b = committed_model_state(runs["two"]), committed_model_state(runs["same"])
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)


def test_resume_on_one_rank_matches_within_fp32_tolerance(runs):
    import torch

    full, other = losses(runs["two"]), losses(runs["on1"])
    for step in range(STOP_AT + 1, STEPS + 1):
        assert abs(other[step] - full[step]) <= 1e-5 * abs(full[step]), (step, other[step], full[step])
    a, b = committed_model_state(runs["two"]), committed_model_state(runs["on1"])
    assert a.keys() == b.keys() and all(torch.allclose(a[k], b[k], rtol=1e-4, atol=1e-6) for k in a)


def test_export_loads_with_peft_and_merged_gives_the_trained_logits(runs, assets, tmp_path):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from fsdpjob.jobs.export import export_from_path

    vocab = json.loads((Path(assets["model_path"]) / "config.json").read_text())["vocab_size"]
    input_ids = torch.randint(3, vocab, (2, 24), generator=torch.Generator().manual_seed(0))
    trained = torch.from_numpy(run_ranks(trained_logits, 1, run_dir=str(runs["two"]), input_ids=input_ids)[0])
    export_from_path(runs["two"], tmp_path / "adapter", "fp32")
    export_from_path(runs["two"], tmp_path / "merged", "fp32", merge=True)
    for folder in (tmp_path / "adapter", runs["two"] / "export"):  # fsdpjob export; checkpoint.export_final
        assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in folder.iterdir()}
    base = AutoModelForCausalLM.from_pretrained(assets["model_path"], dtype=torch.float32)
    with torch.no_grad():
        plain = base(input_ids=input_ids).logits
        peft_logits = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()(input_ids=input_ids).logits
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)(input_ids=input_ids)
    assert (trained - plain).abs().max() > 1e-2  # the adapters changed the model
    torch.testing.assert_close(peft_logits, trained, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(merged.logits, trained, rtol=1e-4, atol=1e-4)


def test_export_merge_of_a_full_checkpoint_is_refused(tmp_path):
    from fsdpjob.jobs.export import ExportError, export_hf

    step_dir = tmp_path / "step-00000001"
    step_dir.mkdir()
    (step_dir / "fsdpjob.json").write_text(json.dumps({"fingerprint": {"model.path": "/m"}}))
    with pytest.raises(ExportError, match="--merge applies to LoRA checkpoints"):
        export_hf(step_dir, tmp_path, tmp_path / "out", "fp32", merge=True)


def test_resume_against_another_base_is_refused(assets, tmp_path):
    import torch
    from safetensors.torch import load_file, save_file

    model = tmp_path / "base"
    shutil.copytree(assets["model_path"], model)
    run_dir = make_run(tmp_path, "rebased", str(model), assets["data_path"], grad_accum=4, steps=2)
    assert train(run_dir, 1) == [0]
    weights = load_file(model / "model.safetensors")  # another fine-tune of the same architecture, same path
    save_file({k: v + 1e-3 * torch.randn_like(v) for k, v in weights.items()}, model / "model.safetensors",
              metadata={"format": "pt"})
    with pytest.raises(AssertionError, match=r"refusing to resume .*model\.path contents: checkpoint has 'sha256:"):
        train(run_dir, 1)
    failed = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()
              if json.loads(x)["event"] == "failed"]
    assert failed and failed[-1]["retryable"] is False and "ResumeRefused" in failed[-1]["error"]


def test_bf16_with_cpu_offload_trains(assets, tmp_path):
    run_dir = make_run(tmp_path, "offload", assets["model_path"], assets["data_path"], grad_accum=4, steps=3)
    spec_file = run_dir / "spec.json"
    meta = json.loads(spec_file.read_text())
    meta["spec"]["fsdp"].update(mixed_precision="bf16", cpu_offload=True)
    spec_file.write_text(json.dumps(meta))
    assert train(run_dir, 1) == [0]
    loss = losses(run_dir)
    assert set(loss) == {1, 2, 3} and loss[3] < loss[1]
