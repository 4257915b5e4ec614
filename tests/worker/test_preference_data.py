"""Preference data on the worker (jobs/data/preference.py, pairtable.py): string pairs, conversations with and
without a prompt field, kto's labelled answers; labels exactly on the answers; the length rules; margins; the
tables' micro-batches, token counts and fingerprints; and the login node's refusals of the same data."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fsdpjob.jobs.data import IGNORE, DataError
from fsdpjob.jobs.data.pairtable import build_pair_table, pad_id_of
from fsdpjob.jobs.data.preference import (
    Pair,
    read_pair_table,
    read_pairs,
    read_unpaired,
    read_unpaired_table,
)
from fsdpjob.jobs.quickstart import build_tokenizer
from fsdpjob.orchestrator.core.errors import InputError
from fsdpjob.orchestrator.core.inputs.checks import check_inputs
from fsdpjob.orchestrator.core.jobspec.spec import DataSpec, load_spec

CORPUS = ["hello world", "the quick brown fox jumps", "12+345=357", "what is two plus two", "four"] * 20
PAIR_FIELDS = {"prompt_field": "prompt", "chosen_field": "chosen", "rejected_field": "rejected"}
KTO_FIELDS = {"prompt_field": "prompt", "completion_field": "completion", "label_field": "label"}


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tok")
    build_tokenizer(out, CORPUS, vocab_size=300)
    return out


@pytest.fixture(scope="module")
def tokenizer(tok_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tok_dir))


def jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def spec(path: Path, seq_len: int = 64, fields: dict | None = None, **extra) -> DataSpec:
    return DataSpec(path=str(path), seq_len=seq_len, packing=False, **(PAIR_FIELDS if fields is None else fields),
                    **extra)


def enc(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def msg(role: str, content: str) -> dict[str, str]:
    return {"role": role, "content": content}


def answer_of(ids: torch.Tensor, labels: torch.Tensor) -> list[int]:
    """The row's targets, checking they are the row's own tokens (labels aligned with input_ids)."""
    on = labels != IGNORE
    assert torch.equal(labels[on], ids[on])
    return ids[on].tolist()


# ---------------------------------------------------------------- reading


def test_string_pairs_are_tokenized_in_one_call_with_the_eos_text_as_trl(tmp_path, tokenizer):
    """TRL 1.16's rule: the prompt with the tokenizer's own special tokens (this one adds no BOS), prompt + answer +
    the EOS token's text in one call, the answer what follows the shared prefix (tests/worker/test_trl_parity.py
    checks it against TRL's own code)."""
    path = jsonl(tmp_path / "p.jsonl", [{"prompt": "what is two plus two", "chosen": " four", "rejected": " 5"},
                                        {"prompt": "hello", "chosen": " world", "rejected": " fox"}])
    pairs = read_pairs(spec(path), tokenizer)
    eos = tokenizer.eos_token_id
    prompt = tokenizer("what is two plus two")["input_ids"]
    assert prompt[0] != tokenizer.bos_token_id  # no post-processor adds one here
    assert pairs[0] == Pair(prompt, [*enc(tokenizer, " four"), eos], [*enc(tokenizer, " 5"), eos], 1, None)
    whole = tokenizer("what is two plus two four" + tokenizer.eos_token)["input_ids"]
    assert pairs[0].prompt_ids + pairs[0].chosen_ids == whole
    assert pairs[1].line == 2 and (pairs.read, pairs.truncated, pairs.dropped) == (2, 0, 0)


def test_pair_table_labels_only_the_answers(tmp_path, tokenizer):
    path = jsonl(tmp_path / "p.jsonl", [{"prompt": "what is two plus two", "chosen": " four", "rejected": " 5 5"},
                                        {"prompt": "hello", "chosen": " world", "rejected": " fox"}])
    pairs = read_pairs(spec(path, seq_len=32), tokenizer)
    table = read_pair_table(spec(path, seq_len=32), tokenizer)
    assert table.chosen_ids.shape == table.rejected_labels.shape == (2, 32) and len(table) == 2
    for i, pair in enumerate(pairs):
        for ids, labels, answer in ((table.chosen_ids, table.chosen_labels, pair.chosen_ids),
                                    (table.rejected_ids, table.rejected_labels, pair.rejected_ids)):
            n, p = len(pair.prompt_ids) + len(answer), len(pair.prompt_ids)
            assert ids[i, :n].tolist() == pair.prompt_ids + answer
            assert (ids[i, n:] == pad_id_of(tokenizer)).all()
            assert (labels[i, :p] == IGNORE).all() and (labels[i, n:] == IGNORE).all()  # prompt and padding
            assert labels[i, p:n].tolist() == answer and answer_of(ids[i], labels[i]) == answer
    assert table.lines.tolist() == [1, 2] and table.margins is None and table.source is None
    assert table.weights is None and table.num_examples == 2
    # Targets after the shift (position 0 never is one) and non-pad positions, both answers together.
    expected = [len(p.chosen_ids) + len(p.rejected_ids) for p in pairs]
    assert table.row_tokens().tolist() == expected
    assert table.row_lengths().tolist() == [2 * len(p.prompt_ids) + e for p, e in zip(pairs, expected)]


def test_conversation_pairs_render_the_prompt_with_the_generation_prompt(tmp_path, tokenizer):
    prompt = [msg("user", "what is two plus two")]
    path = jsonl(tmp_path / "c.jsonl", [{"prompt": prompt, "chosen": [msg("assistant", "four")],
                                         "rejected": [msg("assistant", "5")]}])
    (pair,) = read_pairs(spec(path), tokenizer)
    head = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    assert pair.prompt_ids == enc(tokenizer, head)
    assert tokenizer.decode(pair.chosen_ids) == "four<|eos|>" and tokenizer.decode(pair.rejected_ids) == "5<|eos|>"
    whole = tokenizer.apply_chat_template(prompt + [msg("assistant", "four")], tokenize=False)
    assert tokenizer.decode(pair.prompt_ids + pair.chosen_ids) == whole


def test_implicit_prompt_is_the_shared_leading_messages(tmp_path, tokenizer):
    shared = [msg("system", "be brief"), msg("user", "hello")]
    rows = [{"chosen": shared + [msg("assistant", "world")], "rejected": shared + [msg("assistant", "fox")]}]
    path = jsonl(tmp_path / "i.jsonl", rows)
    fields = {"chosen_field": "chosen", "rejected_field": "rejected"}
    (pair,) = read_pairs(spec(path, fields=fields), tokenizer)
    head = tokenizer.apply_chat_template(shared, tokenize=False, add_generation_prompt=True)
    assert pair.prompt_ids == enc(tokenizer, head) and tokenizer.decode(pair.chosen_ids) == "world<|eos|>"
    # Nothing shared, or one side with nothing after the shared run: refused at the line.
    for bad in ({"chosen": [msg("user", "a"), msg("assistant", "b")],
                 "rejected": [msg("user", "c"), msg("assistant", "d")]},
                {"chosen": shared, "rejected": shared + [msg("assistant", "fox")]}):
        jsonl(path, [rows[0], bad])
        with pytest.raises(DataError, match=r"i\.jsonl:2: .*chosen and rejected share"):
            read_pairs(spec(path, fields=fields), tokenizer)


def test_template_that_breaks_the_prefix_is_named_at_its_line(tmp_path, tok_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tok_dir))
    # Renders the last message differently from the earlier ones, so the prompt is no prefix of the whole.
    tokenizer.chat_template = ("{% for m in messages %}{% if loop.last %}[{{ m['content'] }}]{% else %}"
                               "{{ m['content'] }}{% endif %}{% endfor %}")
    path = jsonl(tmp_path / "t.jsonl", [{"prompt": [msg("user", "hi")], "chosen": [msg("assistant", "a")],
                                         "rejected": [msg("assistant", "b")]}])
    with pytest.raises(DataError, match=r"t\.jsonl:1: the chat template renders the prompt"):
        read_pairs(spec(path), tokenizer)


def test_margins_come_from_the_named_field(tmp_path, tokenizer):
    rows = [{"prompt": "hello", "chosen": " world", "rejected": " fox", "m": 1.5},
            {"prompt": "four", "chosen": " four", "rejected": " 5", "m": 2}]
    path = jsonl(tmp_path / "m.jsonl", rows)
    table = read_pair_table(spec(path), tokenizer, margin_field="m")
    assert table.margins.dtype == torch.float32 and table.margins.tolist() == [1.5, 2.0]
    assert table.micro_batch(torch.tensor([1])).margins.tolist() == [2.0]
    for bad, words in ((None, "missing field 'm' (set by reward.margin_field)"), ("big", "expected a number")):
        jsonl(path, [rows[0], {k: v for k, v in rows[1].items() if k != "m"} | ({"m": bad} if bad else {})])
        with pytest.raises(DataError, match=rf"m\.jsonl:2: .*{re.escape(words)}"):
            read_pairs(spec(path), tokenizer, margin_field="m")


def test_kto_answers_and_their_labels(tmp_path, tokenizer):
    rows = [{"prompt": "hello", "completion": " world", "label": True},
            {"prompt": "hello", "completion": " fox", "label": False},
            {"prompt": "four", "completion": " four", "label": True}]
    path = jsonl(tmp_path / "k.jsonl", rows)
    data = spec(path, fields=KTO_FIELDS)
    answers = read_unpaired(data, tokenizer)
    assert [a.desirable for a in answers] == [True, False, True] and [a.line for a in answers] == [1, 2, 3]
    assert answers[0].prompt_ids == tokenizer("hello")["input_ids"]
    assert answers[0].completion_ids == [*enc(tokenizer, " world"), tokenizer.eos_token_id]
    table = read_unpaired_table(data, tokenizer)
    assert table.desirable.tolist() == [True, False, True] and table.ids.shape == (3, 64)
    for i, a in enumerate(answers):
        assert answer_of(table.ids[i], table.labels[i]) == a.completion_ids
    assert table.row_tokens().tolist() == [len(a.completion_ids) for a in answers]
    assert table.row_lengths().tolist() == [len(a.prompt_ids) + len(a.completion_ids) for a in answers]
    batch = table.micro_batch(torch.tensor([2, 1]))
    assert batch.rows.tolist() == [2, 1] and batch.desirable.tolist() == [True, False]
    assert torch.equal(batch.ids, table.ids[[2, 1]]) and torch.equal(batch.labels, table.labels[[2, 1]])
    long = {"prompt": "hello", "completion": " the quick brown fox jumps" * 9, "label": False}
    jsonl(path, [rows[0], long])
    with pytest.raises(DataError, match="drop left answers of one label only"):
        read_unpaired(spec(path, fields=KTO_FIELDS, long_examples="drop"), tokenizer)
    jsonl(path, [r | {"label": False} for r in rows])
    with pytest.raises(DataError, match=r"k\.jsonl:1: kto needs desirable and undesirable answers.*'label'"):
        read_unpaired(data, tokenizer)


def test_eval_data_is_read_from_its_own_path(tmp_path, tokenizer):
    train = jsonl(tmp_path / "train.jsonl", [{"prompt": "hello", "chosen": " world", "rejected": " fox"}])
    held = jsonl(tmp_path / "eval.jsonl", [{"prompt": "four", "chosen": " four", "rejected": " 5"}] * 2)
    data = spec(train, eval_path=str(held))
    assert len(read_pair_table(data, tokenizer)) == 1
    assert len(read_pair_table(data, tokenizer, path=data.eval_path)) == 2
    kto = jsonl(tmp_path / "k.jsonl", [{"prompt": "a", "completion": " b", "label": True},
                                       {"prompt": "a", "completion": " c", "label": False}])
    kto_eval = jsonl(tmp_path / "ke.jsonl", [{"prompt": "a", "completion": " b", "label": True}])
    data = spec(kto, fields=KTO_FIELDS, eval_path=str(kto_eval))
    assert len(read_unpaired_table(data, tokenizer)) == 2
    with pytest.raises(DataError, match=r"ke\.jsonl:1: kto needs desirable and undesirable"):  # as validate says
        read_unpaired_table(data, tokenizer, path=data.eval_path)


# ---------------------------------------------------------------- length rules


def test_truncate_cuts_the_answers_end_and_keeps_the_prompt(tmp_path, tokenizer):
    long = " the quick brown fox jumps" * 4
    path = jsonl(tmp_path / "l.jsonl", [{"prompt": "hello", "chosen": long, "rejected": " fox"},
                                        {"prompt": "hello", "chosen": " world", "rejected": " fox"}])
    seq_len = 12
    pairs = read_pairs(spec(path, seq_len=seq_len), tokenizer)
    prompt = tokenizer("hello")["input_ids"]
    assert pairs[0].prompt_ids == prompt
    assert pairs[0].chosen_ids == enc(tokenizer, long)[: seq_len - len(prompt)]  # its end (and eos) cut
    assert pairs[0].rejected_ids == [*enc(tokenizer, " fox"), tokenizer.eos_token_id]  # the short one whole
    assert (pairs.read, pairs.truncated, pairs.dropped) == (2, 1, 0)
    table = build_pair_table(pairs, seq_len, pad_id_of(tokenizer))
    assert (table.truncated, table.dropped) == (1, 0) and table.row_lengths()[0] == seq_len + len(prompt) + 2


def test_drop_leaves_the_whole_pair_out(tmp_path, tokenizer):
    long = " the quick brown fox jumps" * 4
    path = jsonl(tmp_path / "d.jsonl", [{"prompt": "hello", "chosen": " world", "rejected": long},
                                        {"prompt": "hello", "chosen": " world", "rejected": " fox"}])
    pairs = read_pairs(spec(path, seq_len=12, long_examples="drop"), tokenizer)
    assert [p.line for p in pairs] == [2] and (pairs.read, pairs.truncated, pairs.dropped) == (2, 0, 1)
    table = read_pair_table(spec(path, seq_len=12, long_examples="drop"), tokenizer)
    assert len(table) == 1 and (table.num_examples, table.dropped) == (2, 1) and table.lines.tolist() == [2]
    jsonl(path, [{"prompt": "hello", "chosen": long, "rejected": long}])
    with pytest.raises(DataError, match="no data left"):
        read_pairs(spec(path, seq_len=12, long_examples="drop"), tokenizer)


def test_prompt_without_room_for_an_answer_is_a_data_error(tmp_path, tokenizer):
    prompt = "the quick brown fox jumps"
    tokens = len(tokenizer(prompt)["input_ids"])
    path = jsonl(tmp_path / "long.jsonl", [{"prompt": "hello", "chosen": " a", "rejected": " b"},
                                           {"prompt": prompt, "chosen": " a", "rejected": " b"}])
    with pytest.raises(DataError) as info:
        read_pairs(spec(path, seq_len=tokens), tokenizer)
    assert str(info.value) == (f"{path}:2: the prompt (field 'prompt', data.prompt_field) is {tokens} tokens and "
                               f"leaves no room for an answer within data.seq_len {tokens}; raise data.seq_len to at "
                               f"least {tokens + 1} or shorten the prompt")
    assert len(read_pairs(spec(path, seq_len=tokens + 1), tokenizer)) == 2  # one answer token fits


# ---------------------------------------------------------------- tables


def test_fingerprint_is_stable_across_processes_and_follows_the_data(tmp_path, tokenizer, tok_dir):
    rows = [{"prompt": "hello", "chosen": " world", "rejected": " fox"}]
    path = jsonl(tmp_path / "f.jsonl", rows)
    first = read_pair_table(spec(path), tokenizer).fingerprint()
    assert first == read_pair_table(spec(path), tokenizer).fingerprint() and len(first) == 64
    code = ("import sys; from transformers import AutoTokenizer; from fsdpjob.jobs.data.preference import "
            "read_pair_table; from fsdpjob.orchestrator.core.jobspec.spec import DataSpec; "
            "print(read_pair_table(DataSpec(path=sys.argv[1], seq_len=64, packing=False, prompt_field='prompt', "
            "chosen_field='chosen', rejected_field='rejected'), AutoTokenizer.from_pretrained(sys.argv[2]))"
            ".fingerprint())")
    other = subprocess.run([sys.executable, "-c", code, str(path), str(tok_dir)], capture_output=True, text=True,
                           check=True, env={"PYTHONHASHSEED": "123", "PATH": "/usr/bin:/bin"})
    assert other.stdout.strip() == first
    jsonl(path, [rows[0] | {"rejected": " world"}])
    assert read_pair_table(spec(path), tokenizer).fingerprint() != first
    assert read_pair_table(spec(path, seq_len=65), tokenizer).fingerprint() != first  # the shape counts too
    kto = jsonl(tmp_path / "k.jsonl", [{"prompt": "a", "completion": " b", "label": True},
                                       {"prompt": "a", "completion": " c", "label": False}])
    a = read_unpaired_table(spec(kto, fields=KTO_FIELDS), tokenizer).fingerprint()
    jsonl(kto, [{"prompt": "a", "completion": " b", "label": True},
                {"prompt": "a", "completion": " d", "label": False}])
    assert a != read_unpaired_table(spec(kto, fields=KTO_FIELDS), tokenizer).fingerprint()


def test_micro_batch_takes_the_pairs_rows(tmp_path, tokenizer):
    path = jsonl(tmp_path / "b.jsonl", [{"prompt": "hello", "chosen": f" {w}", "rejected": " fox"}
                                        for w in ("world", "four", "jumps")])
    table = read_pair_table(spec(path), tokenizer)
    rows = torch.tensor([2, 0])
    batch = table.micro_batch(rows)
    assert batch.rows.tolist() == [2, 0] and batch.margins is None
    for name in ("chosen_ids", "chosen_labels", "rejected_ids", "rejected_labels"):
        assert torch.equal(getattr(batch, name), getattr(table, name)[rows])


def test_parquet_pairs_give_the_jsonl_table(tmp_path, tokenizer):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    rows = [{"prompt": [msg("user", "hello")], "chosen": [msg("assistant", "world")],
             "rejected": [msg("assistant", "fox")]},
            {"prompt": [msg("user", "what is two plus two")], "chosen": [msg("assistant", "four")],
             "rejected": [msg("assistant", "5")]}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "p.parquet")
    from_parquet = read_pair_table(spec(tmp_path / "p.parquet"), tokenizer)
    from_jsonl = read_pair_table(spec(jsonl(tmp_path / "p.jsonl", rows)), tokenizer)
    assert from_parquet.fingerprint() == from_jsonl.fingerprint() and len(from_parquet) == 2
    assert from_parquet.lines.tolist() == [1, 2]


# ---------------------------------------------------------------- the login node


def login_spec(tmp_path: Path, tok_dir: Path, method: str, seq_len: int, rows: list[dict]) -> tuple:
    model = tmp_path / "model"
    model.mkdir()
    for f in tok_dir.iterdir():
        (model / f.name).write_bytes(f.read_bytes())
    (model / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"],
                                                   "max_position_embeddings": 512}))
    (model / "model.safetensors").write_bytes(b"")
    jsonl(tmp_path / "data.jsonl", rows)
    (tmp_path / "job.yaml").write_text(f"name: pref\nmodel:\n  path: model\ndata:\n  path: data.jsonl\n  seq_len: "
                                       f"{seq_len}\ntrain:\n  method: {method}\n  max_steps: 5\n")
    return load_spec(tmp_path / "job.yaml")


def test_validate_refuses_a_string_prompt_without_room_as_the_worker_does(tmp_path, tokenizer, tok_dir):
    prompt = "the quick brown fox jumps"
    tokens = len(tokenizer(prompt)["input_ids"])  # the tokenizer's own special tokens, on both sides
    rows = [{"prompt": "hello", "chosen": " a", "rejected": " b"}, {"prompt": prompt, "chosen": " a", "rejected": " b"}]
    spec_, doc = login_spec(tmp_path, tok_dir, "dpo", tokens, rows)
    with pytest.raises(InputError) as info:
        check_inputs(spec_, doc)
    with pytest.raises(DataError) as worker:
        read_pairs(spec_.data, tokenizer)
    assert info.value.format() == str(worker.value)
    spec_ = spec_.model_copy(update={"data": spec_.data.model_copy(update={"seq_len": tokens + 1})})
    check_inputs(spec_, doc)
