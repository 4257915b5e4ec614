"""Data mixtures (data.sources) for the preference methods: each source's pairs (or kto's answers) read on their
own with its fields, one table with each row's source, and the batch stream drawing every epoch's rows by the
weights as it does for SFT's mixtures; validate's checks per source; a DPO mixture trains on 2 ranks."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import test_preference_data as prefdata
import torch
from test_kto_train import write_answers
from test_preference_data import jsonl, login_spec
from test_preference_train import events, make_run, metrics, train, write_pairs

from fsdpjob.jobs.data import DataError
from fsdpjob.jobs.data.mixture import epoch_counts
from fsdpjob.jobs.data.preference import read_pair_table, read_unpaired_table
from fsdpjob.jobs.data.stream import BatchStream, split_eval
from fsdpjob.jobs.preference.ktobatch import KtoTable
from fsdpjob.orchestrator.core.errors import InputError
from fsdpjob.orchestrator.core.inputs.checks import check_inputs
from fsdpjob.orchestrator.core.jobspec.spec import JobSpec, load_spec
from fsdpjob.orchestrator.core.jobspec.validation import SpecErrors

tok_dir, tokenizer = prefdata.tok_dir, prefdata.tokenizer  # its fixtures: the tiny tokenizer


def renamed(path: Path, new: Path, fields: dict[str, str]) -> Path:
    """``path``'s records with their fields renamed (a source with fields of its own)."""
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    new.write_text("".join(json.dumps({fields.get(k, k): v for k, v in r.items()}) + "\n" for r in rows))
    return new


def mixture(tmp_path: Path, method: str = "dpo", weights: tuple[float, float] = (0.75, 0.25), **data) -> JobSpec:
    """Two sources of 10 and 30 rows; the second names its fields its own way."""
    if method == "kto":
        a, b = write_answers(tmp_path / "a.jsonl", 10), write_answers(tmp_path / "b0.jsonl", 30, seed=1)
        fields = {"prompt": "question", "completion": "reply", "label": "good"}
    else:
        a, b = write_pairs(tmp_path / "a.jsonl", 10), write_pairs(tmp_path / "b0.jsonl", 30, seed=1)
        fields = {"prompt": "question", "chosen": "better", "rejected": "worse"}
    b = renamed(b, tmp_path / "b.jsonl", fields)
    own = {f"{role}_field": name for role, name in fields.items()}
    sources = [{"path": str(a), "weight": weights[0]}, {"path": str(b), "weight": weights[1], **own}]
    train = {"method": method, "max_steps": 5, **({"eval_every": 5} if data.get("eval_fraction") else {})}
    return JobSpec.model_validate({"name": "mix", "model": {"path": "/m"}, "train": train,
                                   "data": {"sources": sources, "seq_len": 16, **data}})


def drawn(table, epochs: int, global_batch: int = 2) -> Counter:
    """Rows each source gave over ``epochs`` epochs of the stream (every rank's, one rank standing for them all)."""
    stream = BatchStream(table, seed=0, shuffle=True, micro_batch_size=global_batch, grad_accum_steps=1, dp_rank=0,
                         dp_world=1, packing="none")
    counts: Counter = Counter()
    for _ in range(epochs * stream.epoch_size // global_batch):
        for batch in stream.next_step().micro_batches:
            counts.update(table.source[batch.rows].tolist())
    return counts


@pytest.mark.parametrize("method", ["dpo", "kto"])
def test_each_source_is_read_with_its_fields_and_the_stream_draws_by_the_weights(tmp_path, tokenizer, method):
    spec = mixture(tmp_path, method)
    read = read_unpaired_table if method == "kto" else read_pair_table
    table = read(spec.data, tokenizer)
    assert len(table) == 40 and table.weights == (0.75, 0.25) and table.num_examples == 40
    assert table.source.tolist() == [0] * 10 + [1] * 30
    # The second source's rows are its own file's, read through its own field names.
    alone = read(spec.data.model_copy(update={"sources": None, "path": str(tmp_path / "b.jsonl"),
                                              **{k: v for k, v in spec.data.sources[1] if k.endswith("_field")}}),
                 tokenizer)
    ids = table.chosen_ids if method != "kto" else table.ids
    assert torch.equal(ids[10:], alone.chosen_ids if method != "kto" else alone.ids)
    # An epoch is 40 rows: 30 from the first source (repeated: 3 passes over its 10), 10 from the second.
    assert epoch_counts([10, 30], (0.75, 0.25)) == [30, 10]
    assert drawn(table, epochs=2) == {0: 60, 1: 20}
    if method == "kto":  # each answer's KL partner comes with the mixture's table, every row one
        kto = KtoTable.of(table, 0, 0)
        assert kto.weights == (0.75, 0.25) and sorted(kto.partners.tolist()) == list(range(40))
        assert drawn(kto, epochs=1) == {0: 30, 1: 10}


def test_an_eval_fraction_holds_rows_out_of_every_source(tmp_path, tokenizer):
    spec = mixture(tmp_path, eval_fraction=0.25)
    table = read_pair_table(spec.data, tokenizer)
    train_part, held, train_rows, eval_rows = split_eval(table, 0.25, seed=0)
    assert train_part.weights == (0.75, 0.25) and torch.equal(train_part.source, table.source[train_rows])
    assert set(train_part.source.tolist()) == {0, 1} and len(held) == 10
    counts = drawn(train_part, epochs=1)
    assert [counts[0], counts[1]] == epoch_counts([int((train_part.source == i).sum()) for i in (0, 1)],
                                                  (0.75, 0.25))


def test_a_source_with_fields_of_another_shape_is_refused(tmp_path):
    write_pairs(tmp_path / "a.jsonl", 2)
    path = tmp_path / "job.yaml"
    path.write_text(f"name: mix\nmodel:\n  path: /m\ndata:\n  sources:\n    - path: {tmp_path / 'a.jsonl'}\n"
                    "      weight: 0.5\n    - path: b.jsonl\n      weight: 0.5\n      text_field: body\n"
                    "train:\n  method: dpo\n  max_steps: 5\n")
    with pytest.raises(SpecErrors) as info:
        load_spec(path)
    (err,) = info.value.errors
    assert err.format().startswith(f"{path}:8: data.sources.1: dpo trains on pairs, and this source's own fields "
                                   "read another shape"), err.format()


def test_validate_refuses_a_prompt_without_room_in_any_source_as_the_worker_does(tmp_path, tokenizer, tok_dir):
    prompt = "the quick brown fox jumps"
    tokens = len(tokenizer.encode(prompt, add_special_tokens=True))  # as TRL counts it (the tokenizer's own rule)
    short = {"prompt": "hello", "chosen": " a", "rejected": " b"}
    login_spec(tmp_path, tok_dir, "dpo", tokens, [short, short | {"prompt": prompt}])  # the model, data.jsonl
    jsonl(tmp_path / "good.jsonl", [short])
    (tmp_path / "job.yaml").write_text(f"name: pref\nmodel:\n  path: model\ndata:\n  seq_len: {tokens}\n  sources:\n"
                                       "    - path: good.jsonl\n      weight: 0.5\n    - path: data.jsonl\n"
                                       "      weight: 0.5\ntrain:\n  method: dpo\n  max_steps: 5\n")
    spec, doc = load_spec(tmp_path / "job.yaml")
    with pytest.raises(InputError) as info:
        check_inputs(spec, doc)
    with pytest.raises(DataError) as worker:
        read_pair_table(spec.data, tokenizer)
    assert info.value.format() == str(worker.value) and "data.jsonl:2:" in str(worker.value)


@pytest.mark.distributed
@pytest.mark.slow
def test_a_dpo_mixture_trains_on_its_sources_by_their_weights(tmp_path):
    from fsdpjob.jobs.quickstart import make_quickstart

    assets = make_quickstart(tmp_path / "assets")
    spec = mixture(tmp_path)
    data = spec.data.model_dump(mode="json", include={"sources", "seq_len"})
    run = make_run(tmp_path, "mixed", {**assets, "pairs": None}, steps=10, more={"data": data})
    # 40 rows an epoch, 4 a step: 10 steps are one epoch, 30 rows of the first source and 10 of the second.
    assert train(run, FSDPJOB_LOG_SAMPLES="1") == [0, 0]
    rows = [r for x in (run / "samples.jsonl").read_text().splitlines() for r in json.loads(x)["ids"]]
    assert Counter(0 if r < 10 else 1 for r in rows) == {0: 30, 1: 10}
    m = metrics(run)
    assert m[1]["loss"] == pytest.approx(0.6931472, abs=1e-6) and m[10]["loss"] < m[1]["loss"], m
    passes = [e for e in events(run) if e["event"] == "reference"]
    assert passes[-1]["phase"] == "done" and passes[-1]["rows"] == 40, passes
