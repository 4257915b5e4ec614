"""Evaluation (train.eval_every): the eval loss against a one-process fp32 computation with the committed weights,
the eval_fraction hold-out never trained on, the schedule across a stop and a resume on another world size,
checkpoint.keep_best, and the spec's errors for eval settings that do not go together."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from distributed import committed_model_state, run_ranks, train_worker

MAX_STEPS = 6


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> dict:
    from fsdpjob.jobs.quickstart import addition_examples, make_quickstart

    out = tmp_path_factory.mktemp("assets")
    made = make_quickstart(out)
    eval_path = out / "eval.jsonl"
    eval_path.write_text("".join(json.dumps({"text": t}) + "\n" for t in addition_examples(40, seed=7)))
    return {**made, "eval_path": str(eval_path)}


def make_run(root: Path, name: str, assets: dict, *, data: dict, train: dict, checkpoint: dict | None = None) -> Path:
    from fsdpjob.orchestrator.core.jobspec.spec import JobSpec

    spec = JobSpec.model_validate({
        "name": name,
        "model": {"path": assets["model_path"]},
        "data": {"path": assets["data_path"], "seq_len": 32, **data},
        "train": {"max_steps": MAX_STEPS, "micro_batch_size": 1, "grad_accum_steps": 2, "lr": 3e-3, "log_every": 1,
                  **train},
        "fsdp": {"mixed_precision": "fp32"},
        "checkpoint": {"interval_steps": 0, "interval_minutes": 0, **(checkpoint or {})},
    })
    run_dir = root / name
    run_dir.mkdir()
    meta = {"spec": spec.model_dump(mode="json"), "resume_from": None, "plan": {"defer_grad_sync": True}}
    (run_dir / "spec.json").write_text(json.dumps(meta))
    return run_dir


def train(run_dir: Path, world: int, **env: str) -> list[int]:
    return run_ranks(train_worker, world, run_dir=str(run_dir), env={"FSDPJOB_LOG_SAMPLES": "1", **env})


def evals(run_dir: Path) -> list[dict]:
    lines = map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    return [m for m in lines if "eval_loss" in m]


def packed(assets: dict, path: str):
    """The sequences the worker packs from ``path`` (same tokenizer, seq_len and packing)."""
    from transformers import AutoTokenizer

    from fsdpjob.jobs.data import build_sequences, read_examples
    from fsdpjob.orchestrator.core.jobspec.spec import DataSpec

    tokenizer = AutoTokenizer.from_pretrained(assets["model_path"])
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    data = DataSpec(path=path, seq_len=32)
    return build_sequences(read_examples(data, tokenizer), data.seq_len, data.packing, pad_id)


def reference_loss(run_dir: Path, assets: dict, table, rows: int | None = None) -> tuple[float, int]:
    """Mean token loss of the newest committed weights in a plain fp32 HF model, one process, no FSDP, over the
    table's first ``rows`` sequences (all by default), each with its examples' positions."""
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    from fsdpjob.jobs.step import forward_logits

    model = AutoModelForCausalLM.from_pretrained(assets["model_path"], torch_dtype=torch.float32)
    weights = committed_model_state(run_dir)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert not unexpected and all("lm_head" in k for k in missing), (missing, unexpected)
    model.eval()
    total, tokens = 0.0, 0
    with torch.no_grad():
        for row in range(len(table) if rows is None else rows):
            ids, lab = table.input_ids[row : row + 1], table.labels[row : row + 1]
            positions = table.position_ids[row : row + 1] if table.position_ids is not None else None
            logits = forward_logits(model, ids, positions, torch.device("cpu"))
            targets = F.pad(lab[:, 1:], (0, 1), value=-100)
            total += F.cross_entropy(logits.reshape(-1, logits.size(-1)).double(), targets.reshape(-1),
                                     ignore_index=-100, reduction="sum").item()
            tokens += int((lab[:, 1:] != -100).sum())
    return total / tokens, tokens


@pytest.fixture(scope="module")
def runs(tmp_path_factory, assets) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("runs")
    # Held out of the training data; stopped at step 3 on 2 ranks, resumed on 1.
    held = make_run(root, "fraction", assets, data={"eval_fraction": 0.05}, train={"eval_every": 2})
    assert train(held, 2, FSDPJOB_STOP_AT_STEP="3") == [0, 0]
    assert train(held, 1) == [0]
    # A file of its own, one micro-batch per rank per evaluation; the best checkpoint kept past keep_last.
    own = make_run(root, "file", assets, data={"eval_path": assets["eval_path"]},
                   train={"eval_every": 2, "eval_batches": 1},
                   checkpoint={"interval_steps": 2, "keep_last": 1, "keep_best": True})
    assert train(own, 2) == [0, 0]
    return {"fraction": held, "file": own}


@pytest.mark.distributed
@pytest.mark.slow
def test_eval_loss_equals_one_process_fp32_loss_with_the_same_weights(runs, assets):
    from fsdpjob.jobs.data import split_eval

    # eval_fraction, whole eval set; the last evaluation (step 6, 1 rank after the resume) saw the final weights.
    table = split_eval(packed(assets, assets["data_path"]), 0.05, seed=0).eval
    expected, tokens = reference_loss(runs["fraction"], assets, table)
    last = evals(runs["fraction"])[-1]
    assert last["step"] == MAX_STEPS and last["eval_tokens"] == tokens
    assert abs(last["eval_loss"] - expected) <= 1e-5 * expected, (last, expected)
    # eval_path with eval_batches 1 on 2 ranks: the eval file's first 2 sequences, each rank one.
    table = packed(assets, assets["eval_path"])
    expected, tokens = reference_loss(runs["file"], assets, table, 2)
    last = evals(runs["file"])[-1]
    assert last["step"] == MAX_STEPS and last["eval_tokens"] == tokens
    assert abs(last["eval_loss"] - expected) <= 1e-5 * expected, (last, expected)


@pytest.mark.distributed
@pytest.mark.slow
def test_schedule_survives_stop_and_resume_on_another_world_size(runs):
    # Evaluations at 2 and (resumed on 1 rank) 4 and 6; the end does not evaluate step 6 twice.
    assert [m["step"] for m in evals(runs["fraction"])] == [2, 4, 6]
    assert [m["step"] for m in evals(runs["file"])] == [2, 4, 6]
    assert all(math.isfinite(m["eval_loss"]) and m["eval_tokens"] > 0 for m in evals(runs["fraction"]))
    events = [json.loads(x) for x in (runs["fraction"] / "events.jsonl").read_text().splitlines()]
    assert [e["world_size"] for e in events if e["event"] == "resume"] == [1]


@pytest.mark.distributed
@pytest.mark.slow
def test_eval_fraction_is_never_trained_on(runs, assets):
    from fsdpjob.jobs.data import split_eval

    full = packed(assets, assets["data_path"])
    _, held_out, _, eval_rows = split_eval(full, 0.05, seed=0)
    trained = [r for line in (runs["fraction"] / "samples.jsonl").read_text().splitlines()
               for r in json.loads(line)["rows"]]
    assert len(trained) == MAX_STEPS * 4  # global batch 4 (1 x 2 x 2 ranks, kept on 1 rank)
    assert not set(trained) & set(eval_rows.tolist())
    data = [json.loads(x) for x in (runs["fraction"] / "events.jsonl").read_text().splitlines()]
    data = [e for e in data if e["event"] == "data"]
    assert {(e["sequences"], e["eval_sequences"]) for e in data} == {(len(full) - len(held_out), len(held_out))}


@pytest.mark.distributed
@pytest.mark.slow
def test_keep_best_keeps_the_lowest_eval_loss_and_records_it(runs):
    from fsdpjob.orchestrator.core.runfolder.ckptlayout import committed_steps
    from fsdpjob.orchestrator.core.runfolder.sidecar import Sidecar

    losses = {m["step"]: m["eval_loss"] for m in evals(runs["file"])}
    kept = {step: Sidecar.read(path) for step, path in committed_steps(runs["file"] / "checkpoints")}
    best = min(losses, key=losses.get)
    assert set(kept) == {best, MAX_STEPS}  # keep_last 1: the newest, and the best
    assert all(side.eval_loss == losses[step] for step, side in kept.items())


def test_purge_keeps_the_best_step_over_keep_last(tmp_path):
    from fsdpjob.jobs.checkpoint import CheckpointManager
    from fsdpjob.orchestrator.core.runfolder.ckptlayout import MARKER, SIDECAR, committed_steps, step_dir_name

    for step, loss in ((2, 1.5), (4, 0.7), (6, 0.9), (8, None)):
        d = tmp_path / step_dir_name(step)
        d.mkdir()
        (d / SIDECAR).write_text(json.dumps({"step": step, **({"eval_loss": loss} if loss is not None else {})}))
        (d / MARKER).write_text("{}")
    CheckpointManager(tmp_path, rank=0, world_size=1, keep_last=1, async_save=False, sidecar={},
                      keep_best=True).purge()
    assert [s for s, _ in committed_steps(tmp_path)] == [4, 8]
    # Without keep_best the purge is as before: keep_last only.
    CheckpointManager(tmp_path, rank=0, world_size=1, keep_last=1, async_save=False, sidecar={}).purge()
    assert [s for s, _ in committed_steps(tmp_path)] == [8]


BASE = "name: unit\nmodel:\n  path: /m\ndata:\n  path: /d.jsonl\n"


@pytest.mark.parametrize("extra, line, loc, words", [
    ("  eval_path: /e.jsonl\n  eval_fraction: 0.1\ntrain:\n  max_steps: 10\n  eval_every: 2\n", 7, "data.eval_fraction",
     "not both"),
    ("train:\n  max_steps: 10\n  eval_every: 2\n", 8, "train.eval_every", "data.eval_path or data.eval_fraction"),
    ("  eval_fraction: 0.1\ntrain:\n  max_steps: 10\n", 6, "data.eval_fraction", "set train.eval_every"),
    ("train:\n  max_steps: 10\n  eval_batches: 3\n", 8, "train.eval_batches", "needs eval_every"),
    ("train:\n  max_steps: 10\ncheckpoint:\n  keep_best: true\n", 9, "checkpoint.keep_best", "set train.eval_every"),
    ("  eval_fraction: 1.0\ntrain:\n  max_steps: 10\n  eval_every: 2\n", 6, "data.eval_fraction", "less than 1"),
])
def test_spec_errors_for_eval_settings_that_do_not_go_together(tmp_path, extra, line, loc, words):
    from fsdpjob.orchestrator.core.jobspec.spec import load_spec
    from fsdpjob.orchestrator.core.jobspec.validation import SpecErrors

    path = tmp_path / "job.yaml"
    path.write_text(BASE + extra)
    with pytest.raises(SpecErrors) as info:
        load_spec(path)
    (err,) = info.value.errors
    assert err.format().startswith(f"{path}:{line}: {loc}: "), err.format()
    assert words in err.format()


def test_eval_settings_resolve_relative_to_the_spec(tmp_path):
    from fsdpjob.orchestrator.core.jobspec.spec import load_spec

    path = tmp_path / "job.yaml"
    path.write_text("name: unit\nmodel:\n  path: m\ndata:\n  path: d.jsonl\n  eval_path: e.jsonl\n"
                    "train:\n  max_steps: 10\n  eval_every: 5\n  eval_batches: 2\ncheckpoint:\n  keep_best: true\n")
    spec, _ = load_spec(path)
    assert spec.data.eval_path == str(tmp_path / "e.jsonl") and spec.train.eval_every == 5
    assert spec.checkpoint.keep_best and spec.data.has_eval


def test_eval_batches_give_every_rank_the_same_count():
    import torch

    from fsdpjob.jobs.data import IGNORE, SequenceTable, eval_batches

    table = SequenceTable(torch.arange(50).view(5, 10), torch.arange(50).view(5, 10), 5, 0)
    per_rank = [eval_batches(table, micro_batch_size=2, max_batches=0, dp_rank=r, dp_world=3) for r in range(3)]
    assert [len(b) for b in per_rank] == [1, 1, 1]
    rows = [int(i) for b in per_rank for mb in b for i in mb.sequence_ids if (mb.labels != IGNORE).any()]
    assert rows == [0, 1, 2, 3, 4]
    capped = [eval_batches(table, micro_batch_size=1, max_batches=1, dp_rank=r, dp_world=2) for r in range(2)]
    assert [[int(mb.sequence_ids[0]) for mb in b] for b in capped] == [[0], [1]]
