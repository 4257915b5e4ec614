"""`fsdpjob validate` on preference data (dpo, orpo, reward: pairs; kto: labelled answers): a file without a pair's
field, or a kto file whose labels are all alike, is refused before submission with one line naming the file, the
line and the field, exit 2; good files pass."""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import helpers
import pytest

fsdpjob = partial(helpers.fsdpjob, timeout_s=60)
PAIR = {"prompt": "1+1=", "chosen": "2", "rejected": "3"}


def job(tmp_path: Path, method: str, data: str = "data.jsonl") -> Path:
    helpers.tiny_model_folder(tmp_path / "model")
    spec = tmp_path / "job.yaml"
    spec.write_text(f"name: pref\nprofile: test-cluster\nmodel:\n  path: model\ndata:\n  path: {data}\n"
                    f"  packing: false\n  seq_len: 128\ntrain:\n  method: {method}\n  max_steps: 5\n")
    return spec


def jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


refused = helpers.refused_at_validate


def test_good_pairs_and_kto_answers_pass(tmp_path):
    job(tmp_path, "dpo")
    jsonl(tmp_path / "data.jsonl", [PAIR, PAIR | {"chosen": "two"}])
    assert fsdpjob("validate", "job.yaml", cwd=tmp_path).returncode == 0
    job(tmp_path / "k", "kto") if (tmp_path / "k").mkdir() is None else None
    jsonl(tmp_path / "k" / "data.jsonl", [{"prompt": "a", "completion": "b", "label": True},
                                          {"prompt": "a", "completion": "c", "label": False}])
    assert fsdpjob("validate", "job.yaml", cwd=tmp_path / "k").returncode == 0


@pytest.mark.parametrize("method", ["dpo", "orpo", "reward"])
def test_a_pair_without_its_chosen_field_is_refused_at_its_line(tmp_path, method):
    job(tmp_path, method)
    data = jsonl(tmp_path / "data.jsonl", [PAIR, {k: v for k, v in PAIR.items() if k != "chosen"}])
    assert refused(tmp_path) == (f"{data}:2: missing field 'chosen' (set by data.chosen_field); this line has "
                                 "'prompt', 'rejected'")


def test_a_pairs_file_with_a_bom_is_read_on_the_login_node_and_the_worker(tmp_path):
    from fsdpjob.jobs.data.sources import load_records
    from fsdpjob.orchestrator.core.jobspec.spec import load_spec

    spec_file = job(tmp_path, "dpo")
    data = jsonl(tmp_path / "data.jsonl", [PAIR, PAIR | {"chosen": "two"}])
    data.write_bytes(b"\xef\xbb\xbf" + data.read_bytes())  # as Windows editors and Excel save UTF-8
    assert fsdpjob("validate", "job.yaml", cwd=tmp_path).returncode == 0
    spec, _ = load_spec(spec_file)
    records = load_records(spec.data.inputs()[0])
    assert [fields for _, fields in records.items] == [PAIR, PAIR | {"chosen": "two"}]


def test_kto_with_one_label_is_refused(tmp_path):
    job(tmp_path, "kto")
    # The whole file is read: a second kind of label past the lines the other checks read still counts.
    rows = [{"prompt": "a", "completion": "b", "label": True}] * 3
    data = jsonl(tmp_path / "data.jsonl", rows)
    assert refused(tmp_path) == (f"{data}:1: kto needs desirable and undesirable answers: every label in field "
                                 "'label' (data.label_field) is true (desirable); add answers of the other kind")
    jsonl(data, [*rows, {"prompt": "a", "completion": "c", "label": False}])
    assert fsdpjob("validate", "job.yaml", cwd=tmp_path).returncode == 0


def test_parquet_pairs_and_labels_are_checked_by_their_columns(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    job(tmp_path, "kto", data="data.parquet")
    rows = [{"prompt": "a", "completion": "b", "label": False}] * 4
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "data.parquet")
    assert refused(tmp_path) == (f"{tmp_path / 'data.parquet'}:1: kto needs desirable and undesirable answers: every "
                                 "label in field 'label' (data.label_field) is false (undesirable); add answers of "
                                 "the other kind")
    pq.write_table(pa.Table.from_pylist([r | {"label": "no"} for r in rows]), tmp_path / "data.parquet")
    assert "column 'label' in" in refused(tmp_path) and "not a boolean column" in refused(tmp_path)
    pq.write_table(pa.Table.from_pylist([*rows, rows[0] | {"label": True}]), tmp_path / "data.parquet")
    assert fsdpjob("validate", "job.yaml", cwd=tmp_path).returncode == 0
    # A pair's fields: strings or messages; a missing chosen column named with the field to set.
    chat_job(tmp_path / "p", "dpo", data="data.parquet") if (tmp_path / "p").mkdir() is None else None
    conversation = {"prompt": [{"role": "user", "content": "hi"}], "chosen": [{"role": "assistant", "content": "a"}],
                    "rejected": [{"role": "assistant", "content": "b"}]}
    pq.write_table(pa.Table.from_pylist([conversation]), tmp_path / "p" / "data.parquet")
    assert fsdpjob("validate", "job.yaml", cwd=tmp_path / "p").returncode == 0
    pq.write_table(pa.Table.from_pylist([{"prompt": "a", "rejected": "b"}]), tmp_path / "p" / "data.parquet")
    line = refused(tmp_path / "p")
    assert "has no column 'chosen'" in line and "set chosen_field" in line, line


def test_reward_margins_are_checked_where_the_pairs_are(tmp_path):
    spec = job(tmp_path, "reward")
    spec.write_text(spec.read_text() + "reward:\n  margin_field: margin\n")
    data = jsonl(tmp_path / "data.jsonl", [PAIR | {"margin": 1.5}, PAIR | {"margin": 2}])
    assert fsdpjob("validate", "job.yaml", cwd=tmp_path).returncode == 0
    jsonl(data, [PAIR | {"margin": 1.5}, PAIR | {"margin": "big"}])
    assert refused(tmp_path) == f"{data}:2: field 'margin': expected a number (the pair's margin), found a string"
    jsonl(data, [PAIR | {"margin": 1.5}, PAIR])
    assert refused(tmp_path).startswith(f"{data}:2: missing field 'margin' (set by reward.margin_field)")
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    spec.write_text(spec.read_text().replace("data.jsonl", "data.parquet"))
    pq.write_table(pa.Table.from_pylist([PAIR | {"margin": "1"}]), tmp_path / "data.parquet")
    line = refused(tmp_path)
    assert line.startswith("job.yaml:13: reward.margin_field: column 'margin' in") and "not a number column" in line


def mixture_job(tmp_path: Path, method: str, extra: str = "") -> Path:
    helpers.tiny_model_folder(tmp_path / "model")
    spec = tmp_path / "job.yaml"
    spec.write_text(f"name: pref\nprofile: test-cluster\nmodel:\n  path: model\ndata:\n  seq_len: 128\n  sources:\n"
                    "    - path: a.jsonl\n      weight: 0.7\n    - path: b.jsonl\n      weight: 0.3\n"
                    f"train:\n  method: {method}\n  max_steps: 5\n{extra}")
    return spec


def test_a_mixture_of_pairs_is_checked_source_by_source(tmp_path):
    mixture_job(tmp_path, "reward", "reward:\n  margin_field: margin\n")
    jsonl(tmp_path / "a.jsonl", [PAIR | {"margin": 1}])
    b = jsonl(tmp_path / "b.jsonl", [PAIR | {"margin": 1}, PAIR | {"margin": 2}])
    assert fsdpjob("validate", "job.yaml", cwd=tmp_path).returncode == 0
    jsonl(b, [PAIR | {"margin": 1}, PAIR])  # the margin is read in every source
    assert refused(tmp_path).startswith(f"{b}:2: missing field 'margin' (set by reward.margin_field)")
    jsonl(b, [PAIR | {"margin": 1}, {k: v for k, v in PAIR.items() if k != "chosen"} | {"margin": 1}])
    assert refused(tmp_path).startswith(f"{b}:2: missing field 'chosen' (set by data.chosen_field)")


def test_a_kto_mixture_checks_each_sources_labels(tmp_path):
    mixture_job(tmp_path, "kto")
    both = [{"prompt": "a", "completion": "b", "label": True}, {"prompt": "a", "completion": "c", "label": False}]
    jsonl(tmp_path / "a.jsonl", both)
    b = jsonl(tmp_path / "b.jsonl", both)
    assert fsdpjob("validate", "job.yaml", cwd=tmp_path).returncode == 0
    jsonl(b, both[:1] * 2)
    assert refused(tmp_path).startswith(f"{b}:1: kto needs desirable and undesirable answers")


USER, BOT = ({"role": "user", "content": "1+1="}, {"role": "assistant", "content": "2"})


def chat_job(tmp_path: Path, method: str, data: str = "data.jsonl") -> Path:
    """job() with a model whose tokenizer has a chat template (conversations pass the template check)."""
    spec = job(tmp_path, method, data)
    (tmp_path / "model" / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages }}"}))
    return spec


def test_an_answer_not_written_by_the_assistant_is_refused_at_its_line(tmp_path):
    chat_job(tmp_path, "dpo")
    good = {"prompt": [USER], "chosen": [BOT], "rejected": [BOT | {"content": "3"}]}
    data = jsonl(tmp_path / "data.jsonl", [good, good | {"rejected": [USER | {"content": "3"}]}])
    assert refused(tmp_path) == (f"{data}:2: field 'rejected': the answer's message 0 has role 'user'; an answer is "
                                 "written by the assistant (role assistant, then assistant or tool): move the other "
                                 "turns into the prompt")


def test_conversations_that_share_no_opening_message_are_refused_at_their_line(tmp_path):
    spec = chat_job(tmp_path, "dpo")
    spec.write_text(spec.read_text().replace("  seq_len: 128\n", "  seq_len: 128\n  prompt_field: null\n"))
    implicit = {"chosen": [USER, BOT], "rejected": [USER, BOT | {"content": "3"}]}
    data = jsonl(tmp_path / "data.jsonl", [implicit, {"chosen": [USER, BOT], "rejected": [BOT, BOT]}])
    assert refused(tmp_path).startswith(f"{data}:2: fields 'chosen' and 'rejected': chosen and rejected share no "
                                        "first message")


def test_conversation_pairs_for_a_model_without_a_chat_template_are_refused_at_the_first(tmp_path):
    job(tmp_path, "orpo")
    data = jsonl(tmp_path / "data.jsonl", [{"prompt": [USER], "chosen": [BOT], "rejected": [BOT]}])
    assert refused(tmp_path) == (f"{data}:1: field 'prompt': the record is a conversation, and the tokenizer in "
                                 f"{tmp_path / 'model'} has no chat template to render it; give strings or add a "
                                 "chat template")


@pytest.mark.parametrize("loss_type", ["ipo", "hinge", "sigmoid_norm"])
def test_label_smoothing_with_a_loss_that_ignores_it_is_refused(tmp_path, loss_type):
    spec = job(tmp_path, "dpo")
    spec.write_text(spec.read_text() + f"dpo:\n  loss_type: {loss_type}\n  label_smoothing: 0.1\n")
    jsonl(tmp_path / "data.jsonl", [PAIR])
    assert refused(tmp_path) == (f"job.yaml:14: dpo.label_smoothing: loss_type {loss_type} has no label smoothing "
                                 "(cDPO is sigmoid's, robust DPO robust's): it would be ignored; drop label_smoothing "
                                 "or use loss_type sigmoid or robust")


SFT_TERM = ("TRL's sft loss beside a DPO loss is fsdpjob's dpo.rpo_alpha, the weight of the SFT term on the chosen "
            "answers")


@pytest.mark.parametrize("loss_type, words", [
    ("[sigmoid, sft]", f"one loss_type: {SFT_TERM}; set loss_type: sigmoid and rpo_alpha: the sft loss's weight "
                       "(TRL's loss_weights [1, alpha]; 1.0 without loss_weights)"),
    ("[sigmoid, hinge]", f"one loss_type, not a list: fsdpjob combines no losses ({SFT_TERM}); give one of sigmoid, "
                         "ipo, hinge, robust, sigmoid_norm"),
    ("sft", f"sft is no DPO loss: {SFT_TERM}; alone it is train.method: sft"),
])
def test_trls_loss_lists_and_its_sft_loss_point_at_rpo_alpha(tmp_path, loss_type, words):
    spec = job(tmp_path, "dpo")
    spec.write_text(spec.read_text() + f"dpo:\n  loss_type: {loss_type}\n")
    jsonl(tmp_path / "data.jsonl", [PAIR])
    assert refused(tmp_path) == f"job.yaml:13: dpo.loss_type: {words}"
