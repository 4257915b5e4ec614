"""A Bradley-Terry reward model end to end (jobs.train.run on 2 real gloo ranks): the tiny model's backbone with a
scalar head learns to score the right sum above zeros; its export loads with AutoModelForSequenceClassification and
ranks the training pairs; a stop at step 5 resumes bitwise; a margin column is read and changes the loss."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from distributed import committed_model_state, write_run
from test_preference_train import metrics, train, write_pairs

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

STEPS, STOP_AT = 15, 5


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> dict:
    from fsdpjob.jobs.quickstart import make_quickstart

    folder = tmp_path_factory.mktemp("assets")
    made = make_quickstart(folder)
    pairs = write_pairs(folder / "pairs.jsonl", 40)
    with_margin = folder / "margins.jsonl"
    with_margin.write_text("".join(json.dumps({**json.loads(line), "margin": 2.0}) + "\n"
                                   for line in pairs.read_text().splitlines()))
    return {**made, "pairs": str(pairs), "margins": str(with_margin)}


def reward_spec(assets: dict, *, steps: int = STEPS, options: dict | None = None, pairs: str = "pairs") -> dict:
    return {
        "model": {"path": assets["model_path"]},
        "data": {"path": assets[pairs], "seq_len": 16},
        # Global batch 4 pairs = 1 x 2 x 2 ranks.
        "train": {"max_steps": steps, "micro_batch_size": 1, "grad_accum_steps": 2, "lr": 3e-4, "log_every": 1,
                  "method": "reward", "lr_schedule": "constant", "seed": 1},  # seed 1: the new head ranks wrong
        "fsdp": {"mixed_precision": "fp32"},
        "checkpoint": {"interval_steps": 0, "interval_minutes": 0, "export_final": True},
        **({"reward": options} if options is not None else {}),
    }


def reward_run(root: Path, name: str, assets: dict, **kwargs) -> Path:
    return write_run(root, name, reward_spec(assets, **kwargs))


@pytest.fixture(scope="module")
def runs(tmp_path_factory, assets) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("runs")
    full = reward_run(root, "full", assets)
    assert train(full) == [0, 0]
    stopped = reward_run(root, "stopped", assets)
    assert train(stopped, FSDPJOB_STOP_AT_STEP=str(STOP_AT)) == [0, 0]
    assert train(stopped) == [0, 0]
    return {"full": full, "stopped": stopped}


def test_the_loss_falls_and_the_accuracy_rises(runs):
    m = metrics(runs["full"])
    assert set(m) == set(range(1, STEPS + 1))
    first, last = (sum(m[s]["loss"] for s in steps) / 3 for steps in ((1, 2, 3), range(STEPS - 2, STEPS + 1)))
    assert last < first - 0.1, (first, last)
    # train.seed 1's draw of the new head scores zeros above the sums at first; training turns that round.
    late = sum(m[s]["accuracy"] for s in range(STEPS - 3, STEPS + 1)) / 4
    assert m[1]["accuracy"] <= 0.5 and late >= 0.9, (m[1]["accuracy"], late)
    for key in ("accuracy", "margin", "mean_reward", "rewards/chosen", "rewards/rejected", "rewards/accuracies",
                "rewards/margins"):
        assert all(math.isfinite(m[s][key]) for s in m), key
    assert all(m[s]["accuracy"] == m[s]["rewards/accuracies"] for s in m)
    assert "logps/chosen" not in m[1]  # a reward model has no answer log-probabilities


def test_the_export_is_a_sequence_classifier_that_ranks_the_training_pairs(runs, assets):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from fsdpjob.jobs.data.preference import read_pair_table
    from fsdpjob.orchestrator.core.jobspec.spec import JobSpec

    folder = runs["full"] / "export"
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["LlamaForSequenceClassification"] and config["num_labels"] == 1, config
    model = AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float32).eval()
    assert model.score.weight.shape == (1, 128)
    spec = JobSpec.model_validate({"name": "full", **reward_spec(assets)})
    table = read_pair_table(spec.data, AutoTokenizer.from_pretrained(folder))
    with torch.no_grad():
        chosen = model(input_ids=table.chosen_ids).logits.squeeze(-1)
        rejected = model(input_ids=table.rejected_ids).logits.squeeze(-1)
        # Right-padded rows are scored at their last real token: as each row alone, without its padding.
        alone = torch.cat([model(input_ids=table.chosen_ids[i:i + 1, :n]).logits for i, n in
                           enumerate(table.lengths[:4, 0].tolist())]).squeeze(-1)
    assert torch.allclose(alone, chosen[:4], atol=1e-5), (alone, chosen[:4])
    assert (chosen > rejected).float().mean() >= 0.8, (chosen, rejected)


def test_a_stop_at_step_5_resumes_bitwise(runs):
    full, stopped = metrics(runs["full"]), metrics(runs["stopped"])
    assert [full[s]["loss"] for s in full] == [stopped[s]["loss"] for s in full]
    assert [full[s]["accuracy"] for s in full] == [stopped[s]["accuracy"] for s in full]
    a, b = committed_model_state(runs["full"]), committed_model_state(runs["stopped"])
    assert any(k.endswith("score.weight") for k in a)
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)


def test_the_rank0_weight_read_gives_the_sharded_start(tmp_path, assets, runs):
    # FSDPJOB_WEIGHT_LOAD=rank0: rank 0 reads the causal LM and broadcasts the backbone and the head's draw.
    rank0 = reward_run(tmp_path, "rank0", assets, steps=2)
    assert train(rank0, FSDPJOB_WEIGHT_LOAD="rank0") == [0, 0]
    full, read = metrics(runs["full"]), metrics(rank0)
    assert [full[s]["loss"] for s in (1, 2)] == [read[s]["loss"] for s in (1, 2)]


def test_a_margin_column_is_read_and_raises_the_loss(tmp_path, assets, runs):
    margin = reward_run(tmp_path, "margin", assets, steps=2, options={"margin_field": "margin"}, pairs="margins")
    assert train(margin) == [0, 0]
    plain, with_margin = metrics(runs["full"])[1], metrics(margin)[1]
    # The same start and the same first batch: the same scores, each pair's loss -logsigmoid(d - 2) > -logsigmoid(d).
    assert with_margin["margin"] == pytest.approx(plain["margin"], abs=1e-6)
    assert with_margin["loss"] > plain["loss"] + 0.5, (plain, with_margin)


def test_fsdpjob_export_writes_the_same_classifier(runs, tmp_path):
    from transformers import AutoModelForSequenceClassification

    from fsdpjob.jobs.export.full import export_from_path

    export_from_path(runs["full"], tmp_path / "fp32", dtype="fp32")  # what `fsdpjob export RUN` calls
    fp32 = AutoModelForSequenceClassification.from_pretrained(tmp_path / "fp32")
    bf16 = AutoModelForSequenceClassification.from_pretrained(runs["full"] / "export", dtype=torch.float32)
    assert type(fp32).__name__ == "LlamaForSequenceClassification" and fp32.config.pad_token_id == 0
    assert torch.equal(fp32.score.weight.to(torch.bfloat16).float(), bf16.score.weight)


def test_lora_with_a_reward_model_is_refused_at_validate(assets):
    from pydantic import ValidationError

    from fsdpjob.orchestrator.core.jobspec.spec import JobSpec

    spec = reward_spec(assets)
    spec["model"]["lora"] = {"r": 4}
    with pytest.raises(ValidationError, match="a reward model is trained in full"):
        JobSpec.model_validate({"name": "lora", **spec})
