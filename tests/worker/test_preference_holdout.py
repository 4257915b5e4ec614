"""data.eval_fraction for the preference methods: whole pairs (or kto's answers, each with its KL partner on its
own side) held out of the training rows from train.seed, evaluated as data.eval_path's rows are (their own cached
reference pass, eval_loss and the method's eval metrics, keep_best), and never trained on."""

from __future__ import annotations

import json

import pytest
import torch
from test_preference_train import events, make_run, train, write_pairs

from fsdpjob.jobs.data.pairtable import UnpairedTable, build_pair_table
from fsdpjob.jobs.data.preference import Pair, Unpaired
from fsdpjob.jobs.data.stream import split_eval
from fsdpjob.jobs.preference.ktobatch import KtoTable
from fsdpjob.orchestrator.core.jobspec.spec import load_spec
from fsdpjob.orchestrator.core.jobspec.validation import SpecErrors


def pair_table(n: int):
    # Pair i: prompt [1, i + 10], chosen [i + 200], rejected [i + 300]: every row tells its pair apart.
    return build_pair_table([Pair([1, i + 10], [i + 200], [i + 300], line=i + 1) for i in range(n)], 6, 0)


def test_a_split_holds_whole_pairs_out_deterministically():
    table = pair_table(20)
    train_part, held, train_rows, eval_rows = split_eval(table, 0.25, seed=3)
    assert (len(train_part), len(held)) == (15, 5)
    assert not set(train_rows.tolist()) & set(eval_rows.tolist())
    assert sorted(train_rows.tolist() + eval_rows.tolist()) == list(range(20))
    # Each side's row is one pair, both answers of it: the chosen and rejected rows of the same line.
    for part, rows in ((train_part, train_rows), (held, eval_rows)):
        assert part.lines.tolist() == (rows + 1).tolist()
        assert (part.chosen_ids[:, 1] + 190 == part.chosen_ids[:, 2]).all()
        assert (part.rejected_ids[:, 1] + 290 == part.rejected_ids[:, 2]).all()
        assert part.lengths.shape == (len(rows), 2)
    again = split_eval(pair_table(20), 0.25, seed=3)
    assert torch.equal(again.eval_rows, eval_rows) and not torch.equal(split_eval(table, 0.25, 4).eval_rows, eval_rows)


def test_kto_answers_take_their_kl_partners_on_their_own_side():
    answers = [Unpaired([1, i + 10], [i + 200], desirable=i % 2 == 0, line=i + 1) for i in range(16)]
    from fsdpjob.jobs.data.pairtable import build_unpaired_table

    table = build_unpaired_table(answers, 6, 0)
    assert isinstance(table, UnpairedTable)
    train_part, held, _, _ = split_eval(table, 0.25, seed=0)
    for part in (train_part, held):
        kto = KtoTable.of(part, 0, 0)
        assert sorted(kto.partners.tolist()) == list(range(len(part)))  # partners are rows of this side only
        kl = kto.micro_batch(torch.arange(len(part)))
        own = set(part.ids[:, 2].tolist())
        assert set(kl.kl_ids[:, 2].tolist()) <= own  # every mismatched completion comes from the same side
    with pytest.raises(TypeError, match="take the rows of the UnpairedTable"):
        KtoTable.of(table, 0, 0).take(torch.arange(3))


BASE = "name: unit\nmodel:\n  path: /m\ndata:\n  path: /d.jsonl\n"


@pytest.mark.parametrize("method", ["dpo", "orpo", "kto", "reward"])
def test_the_spec_takes_an_eval_fraction_for_every_preference_method(tmp_path, method):
    path = tmp_path / "job.yaml"
    path.write_text(BASE + f"  eval_fraction: 0.1\ntrain:\n  method: {method}\n  max_steps: 10\n  eval_every: 2\n")
    spec, _ = load_spec(path)
    assert spec.data.eval_fraction == 0.1 and spec.data.packing is False


@pytest.mark.parametrize("extra, loc, words", [
    ("  eval_fraction: 0.1\ntrain:\n  method: dpo\n  max_steps: 10\n", "data.eval_fraction", "set train.eval_every"),
    ("  eval_fraction: 0.1\n  eval_path: /e.jsonl\ntrain:\n  method: kto\n  max_steps: 10\n  eval_every: 2\n",
     "data.eval_fraction", "not both"),
    ("  eval_fraction: 1.0\ntrain:\n  method: orpo\n  max_steps: 10\n  eval_every: 2\n", "data.eval_fraction",
     "less than 1"),
])
def test_an_eval_fraction_that_does_not_go_with_its_settings_is_refused(tmp_path, extra, loc, words):
    path = tmp_path / "job.yaml"
    path.write_text(BASE + extra)
    with pytest.raises(SpecErrors) as info:
        load_spec(path)
    (err,) = info.value.errors
    assert f": {loc}: " in err.format() and words in err.format(), err.format()


@pytest.mark.distributed
@pytest.mark.slow
def test_dpo_evaluates_on_the_held_out_pairs_and_never_trains_on_them(tmp_path):
    from fsdpjob.jobs.quickstart import make_quickstart

    made = make_quickstart(tmp_path / "assets")
    assets = {**made, "pairs": str(write_pairs(tmp_path / "pairs.jsonl", 40))}
    run = make_run(tmp_path, "held", assets, steps=8, more={
        "data": {"eval_fraction": 0.25}, "train": {"eval_every": 4},
        "checkpoint": {"keep_best": True, "interval_steps": 4}})
    assert train(run, FSDPJOB_LOG_SAMPLES="1") == [0, 0]
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    evaluated = {m["step"]: m for m in lines if "eval_loss" in m}
    assert sorted(evaluated) == [4, 8], evaluated
    assert evaluated[8]["eval_tokens"] == 10 and 0 <= evaluated[8]["eval_rewards/accuracies"] <= 1, evaluated
    assert "eval_rewards/margins" in evaluated[8] and "eval_logps/chosen" in evaluated[8]
    # The held-out pairs had their own reference pass, over 10 rows; training's over the other 30.
    passes = [(e.get("table", "train"), e["phase"], e.get("rows")) for e in events(run) if e["event"] == "reference"]
    assert passes == [("train", "start", 30), ("train", "done", 30), ("eval", "start", 10), ("eval", "done", 10)]
    data = next(e for e in events(run) if e["event"] == "data")
    assert (data["sequences"], data["eval_sequences"]) == (30, 10), data
    # Never trained on: the rows every step took (places in the file's 40 pairs) miss the held-out ones.
    _, _, _, eval_rows = split_eval(pair_table(40), 0.25, seed=0)  # the split depends on the row count and seed
    trained = [r for x in (run / "samples.jsonl").read_text().splitlines() for r in json.loads(x)["rows"]]
    assert len(trained) == 8 * 4 and not set(trained) & set(eval_rows.tolist()), trained
    facts = json.loads((run / "checkpoints" / "step-00000008" / "fsdpjob.json").read_text())
    assert facts["eval_loss"] == pytest.approx(evaluated[8]["eval_loss"]), facts
