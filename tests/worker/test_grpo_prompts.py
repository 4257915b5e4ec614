"""GRPO's prompt table on the worker (jobs/grpo/prompts.py): string prompts with bos, chat prompts rendered with
the generation prompt, every other field kept for the reward functions, parquet like JSONL, the fingerprint, and a
too-long prompt refused at its line in the login check's words."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fsdpjob.jobs.data import DataError
from fsdpjob.jobs.grpo.prompts import PromptTable, read_prompt_table
from fsdpjob.jobs.quickstart import build_tokenizer
from fsdpjob.orchestrator.core.jobspec.spec import DataSpec

CORPUS = ["What is 12+7?", "what is two plus two", "19 4 the answer"] * 20
ROWS = [{"prompt": "What is 12+7?", "answer": "19"},
        {"prompt": [{"role": "user", "content": "what is two plus two"}], "answer": "4", "level": 2}]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("tok")
    build_tokenizer(out, CORPUS, vocab_size=200)
    return AutoTokenizer.from_pretrained(out)


def spec(path: Path, seq_len: int = 64) -> DataSpec:
    return DataSpec(path=str(path), prompt_field="prompt", packing=False, seq_len=seq_len)


def jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_strings_get_bos_and_chat_prompts_the_generation_prompt(tmp_path, tokenizer):
    table = read_prompt_table(spec(jsonl(tmp_path / "p.jsonl", ROWS)), tokenizer, max_prompt_tokens=48)
    assert isinstance(table, PromptTable) and len(table) == 2
    assert table.prompts == [r["prompt"] for r in ROWS]
    plain = tokenizer("What is 12+7?", add_special_tokens=False)["input_ids"]
    assert table.prompt_ids[0] == [tokenizer.bos_token_id, *plain]
    rendered = tokenizer.apply_chat_template(ROWS[1]["prompt"], tokenize=False, add_generation_prompt=True)
    assert table.prompt_ids[1] == tokenizer(rendered, add_special_tokens=False)["input_ids"]
    assert table.fields == [{"answer": "19", "level": None}, {"answer": "4", "level": 2}]
    assert table.field_names == ["answer", "level"]
    assert table.places == [f"{tmp_path / 'p.jsonl'}:1", f"{tmp_path / 'p.jsonl'}:2"]


def test_parquet_prompts_read_as_jsonl_ones(tmp_path, tokenizer):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    rows = [{"prompt": "What is 12+7?", "answer": "19"}, {"prompt": "what is two plus two", "answer": "4"}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "p.parquet")
    from_table = read_prompt_table(spec(tmp_path / "p.parquet"), tokenizer, max_prompt_tokens=48)
    from_lines = read_prompt_table(spec(jsonl(tmp_path / "p.jsonl", rows)), tokenizer, max_prompt_tokens=48)
    assert from_table.prompt_ids == from_lines.prompt_ids and from_table.fields == from_lines.fields
    assert from_table.fingerprint() == from_lines.fingerprint()


def test_fingerprint_follows_the_token_ids(tmp_path, tokenizer):
    one = read_prompt_table(spec(jsonl(tmp_path / "a.jsonl", ROWS)), tokenizer, max_prompt_tokens=48)
    again = read_prompt_table(spec(jsonl(tmp_path / "b.jsonl", ROWS)), tokenizer, max_prompt_tokens=48)
    other = read_prompt_table(spec(jsonl(tmp_path / "c.jsonl", ROWS[:1])), tokenizer, max_prompt_tokens=48)
    assert one.fingerprint() == again.fingerprint() != other.fingerprint()
    assert len(one.fingerprint()) == 64


def test_a_too_long_prompt_is_refused_at_its_line(tmp_path, tokenizer):
    path = jsonl(tmp_path / "p.jsonl", ROWS)
    chat_tokens = len(read_prompt_table(spec(path), tokenizer, max_prompt_tokens=48).prompt_ids[1])
    with pytest.raises(DataError) as caught:
        read_prompt_table(spec(path, seq_len=chat_tokens + 9), tokenizer, max_prompt_tokens=chat_tokens - 1)
    assert str(caught.value) == (
        f"{path}:2: the prompt (field 'prompt', data.prompt_field) is {chat_tokens} tokens, more than the "
        f"{chat_tokens - 1} that data.seq_len {chat_tokens + 9} leaves beside grpo.max_new_tokens 10; raise "
        f"data.seq_len to at least {chat_tokens + 10}, lower grpo.max_new_tokens or shorten the prompt")


def test_bad_records_are_data_errors_at_their_line(tmp_path, tokenizer):
    path = jsonl(tmp_path / "p.jsonl", [ROWS[0], {"question": "x"}])
    with pytest.raises(DataError, match=r"p.jsonl:2: missing field 'prompt' \(set by data.prompt_field\)"):
        read_prompt_table(spec(path), tokenizer, max_prompt_tokens=48)
    jsonl(path, [ROWS[0] | {"completions": "x"}])
    with pytest.raises(DataError, match="p.jsonl:1: the records have a field 'completions'"):
        read_prompt_table(spec(path), tokenizer, max_prompt_tokens=48)
    path.write_text("")
    with pytest.raises(DataError, match="no prompts"):
        read_prompt_table(spec(path), tokenizer, max_prompt_tokens=48)
