"""Data formats and mixtures on the worker: parquet files (a file, a folder, a glob) and save_to_disk folders
read to exactly the table their JSONL twin gives, for every shape; bad rows named by file and row; a weighted
mixture's stream deterministic, resumable and reshardable; the data cache's key covering sources, weights
and file contents. Every file here is written by pyarrow or `datasets` itself."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
datasets = pytest.importorskip("datasets")

from fsdpjob.jobs.data import BatchStream, DataError, build_sequences, read_examples, split_eval  # noqa: E402
from fsdpjob.jobs.data.cache import load_or_build, table_key  # noqa: E402
from fsdpjob.jobs.data.mixture import epoch_counts  # noqa: E402
from fsdpjob.jobs.data.sources import build_table  # noqa: E402
from fsdpjob.jobs.quickstart import build_tokenizer  # noqa: E402
from fsdpjob.orchestrator.core.jobspec.spec import DataSpec  # noqa: E402

CORPUS = ["hello world", "the quick brown fox jumps", "12+345=357", "naïve café 日本語 🎉"] * 20
TEXTS = [f"{i} + {i} = {2 * i} fox" for i in range(40)]
CHATS = [[{"role": "user", "content": f"add {i}"}, {"role": "assistant", "content": f"{i + i} fox"}]
         for i in range(12)]
SHAPES = {
    "text": ([{"text": t} for t in TEXTS], {}),
    "prompt_completion": ([{"q": f"{i}+{i}=", "a": str(2 * i)} for i in range(30)],
                          {"prompt_field": "q", "completion_field": "a"}),
    "chat": ([{"conv": c} for c in CHATS], {"messages_field": "conv"}),
}


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tok")
    build_tokenizer(out, CORPUS + TEXTS, vocab_size=300)
    return out


@pytest.fixture(scope="module")
def tokenizer(tok_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tok_dir))


def jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def parquet(path: Path, rows: list[dict], **kwargs) -> Path:
    pq.write_table(pa.Table.from_pylist(rows), path, **kwargs)
    return path


def table_of(data: DataSpec, tokenizer):
    return build_table(data, tokenizer, tokenizer.pad_token_id)


def same(a, b) -> bool:
    return torch.equal(a.input_ids, b.input_ids) and torch.equal(a.labels, b.labels) and len(a) > 1


# ---------------------------------------------------------------- formats


@pytest.mark.parametrize("shape", SHAPES)
def test_parquet_and_save_to_disk_give_the_jsonl_table(tmp_path, tokenizer, shape):
    rows, fields = SHAPES[shape]
    reference = build_sequences(read_examples(DataSpec(path=str(jsonl(tmp_path / "d.jsonl", rows)), seq_len=16,
                                                       **fields), tokenizer), 16, True, tokenizer.pad_token_id)
    one = parquet(tmp_path / "d.parquet", rows)
    (tmp_path / "parts").mkdir()
    parquet(tmp_path / "parts" / "a-0.parquet", rows[:5], row_group_size=2)  # several row groups and files
    parquet(tmp_path / "parts" / "a-1.parquet", rows[5:])
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows),
                          "test": datasets.Dataset.from_list(rows[:2])}).save_to_disk(str(tmp_path / "dict"))
    for path, extra in [(one, {}), (tmp_path / "parts", {}), (tmp_path / "parts" / "*.parquet", {}),
                        (tmp_path / "saved", {}), (tmp_path / "dict", {}), (tmp_path / "dict", {"split": "train"})]:
        got = table_of(DataSpec(path=str(path), seq_len=16, **fields, **extra), tokenizer)
        assert same(got, reference), path
    test_split = table_of(DataSpec(path=str(tmp_path / "dict"), split="test", seq_len=16, **fields), tokenizer)
    assert len(test_split) < len(reference)


def test_format_can_be_named_and_extra_columns_are_ignored(tmp_path, tokenizer):
    rows = [{"text": t, "id": i, "meta": {"x": [1.5]}} for i, t in enumerate(TEXTS)]
    plain = table_of(DataSpec(path=str(jsonl(tmp_path / "d.jsonl", [{"text": t} for t in TEXTS])), seq_len=16),
                     tokenizer)
    odd_name = parquet(tmp_path / "train.data", rows)
    got = table_of(DataSpec(path=str(odd_name), format="parquet", seq_len=16), tokenizer)
    assert same(got, plain)


def test_chat_messages_with_extra_keys_from_arrow_structs(tmp_path, tokenizer):
    """Arrow gives every message every key of the struct (null where a message lacks it); they are dropped, so
    the chat template sees the messages a JSONL line would give."""
    chats = [[{"role": "user", "content": "hi", "name": "ann"}, {"role": "assistant", "content": "yo"}]] * 4
    from_jsonl = table_of(DataSpec(path=str(jsonl(tmp_path / "d.jsonl", [{"m": c} for c in chats])),
                                   messages_field="m", seq_len=16), tokenizer)
    path = parquet(tmp_path / "d.parquet", [{"m": c} for c in chats])
    assert pq.read_schema(path).field("m").type.value_type.get_field_index("name") >= 0
    assert same(table_of(DataSpec(path=str(path), messages_field="m", seq_len=16), tokenizer), from_jsonl)


def test_bad_rows_are_named_by_file_and_row(tmp_path, tokenizer):
    (tmp_path / "parts").mkdir()
    parquet(tmp_path / "parts" / "0.parquet", [{"text": "a"}] * 3)
    bad = parquet(tmp_path / "parts" / "1.parquet", [{"text": "a"}, {"text": None}])
    with pytest.raises(DataError) as info:
        table_of(DataSpec(path=str(tmp_path / "parts")), tokenizer)
    assert (info.value.file, info.value.line) == (str(bad), 2) and "expected a string, found null" in str(info.value)

    tokenizer = type(tokenizer).from_pretrained(tokenizer.name_or_path)
    tokenizer.chat_template = ("{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}"
                               "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    chats = [{"m": CHATS[0]}, {"m": CHATS[1]}, {"m": [{"role": "assistant", "content": "x"}]}]
    datasets.Dataset.from_list(chats).save_to_disk(str(tmp_path / "saved"))
    with pytest.raises(DataError) as info:
        table_of(DataSpec(path=str(tmp_path / "saved"), messages_field="m"), tokenizer)
    assert (info.value.file, info.value.line) == (str(tmp_path / "saved"), 3)
    assert "the chat template rejected this conversation: user first" in str(info.value)


# ---------------------------------------------------------------- mixtures


def mixture(tmp_path: Path, weights=(0.75, 0.25), **data) -> DataSpec:
    big = parquet(tmp_path / "big.parquet", [{"text": t} for t in TEXTS])
    datasets.Dataset.from_list([{"body": f"small {i} fox"} for i in range(6)]).save_to_disk(str(tmp_path / "small"))
    sources = [{"path": str(big), "weight": weights[0]},
               {"path": str(tmp_path / "small"), "weight": weights[1], "text_field": "body"}]
    return DataSpec(sources=sources, seq_len=8, **data)


def stream(table, world: int, rank: int, *, gbs: int = 12, mbs: int = 2, shuffle: bool = True) -> BatchStream:
    return BatchStream(table, seed=5, shuffle=shuffle, micro_batch_size=mbs, grad_accum_steps=gbs // (mbs * world),
                       dp_rank=rank, dp_world=world)


def step_rows(streams: list[BatchStream]) -> list[int]:
    return sorted(int(r) for s in streams for mb in s.next_step().micro_batches for r in mb.sequence_ids)


def test_mixture_table_keeps_sources_apart(tmp_path, tokenizer):
    data = mixture(tmp_path)
    table = table_of(data, tokenizer)
    big = table_of(DataSpec(path=data.sources[0].path, seq_len=8), tokenizer)
    small = table_of(DataSpec(path=data.sources[1].path, text_field="body", seq_len=8), tokenizer)
    assert torch.equal(table.input_ids, torch.cat([big.input_ids, small.input_ids]))
    assert table.source.tolist() == [0] * len(big) + [1] * len(small) and table.weights == (0.75, 0.25)
    assert table.num_examples == 46


def test_mixture_epochs_follow_the_weights(tmp_path, tokenizer):
    table = table_of(mixture(tmp_path), tokenizer)
    n_big = int((table.source == 0).sum())
    counts = epoch_counts([n_big, len(table) - n_big], (0.75, 0.25))
    # Largest remainder: each count within half a row of its share (46 rows: 34.5 and 11.5, the tie to source 0).
    assert sum(counts) == len(table) and abs(counts[0] - 0.75 * len(table)) <= 0.5
    s = stream(table, 1, 0, gbs=1, mbs=1)
    assert s.epoch_size == len(table)
    rows = [step_rows([s])[0] for _ in range(3 * s.epoch_size)]
    for epoch in range(3):
        seen = rows[epoch * s.epoch_size:(epoch + 1) * s.epoch_size]
        by_source = Counter(int(table.source[r]) for r in seen)
        assert [by_source[0], by_source[1]] == counts
    # The small source repeats; the big one (more rows than its share) is cycled through: no row twice in an
    # epoch, and the next epoch goes on with the rows not seen yet.
    big_rows = [[r for r in rows[e * s.epoch_size:(e + 1) * s.epoch_size] if table.source[r] == 0] for e in (0, 1)]
    assert counts[0] < n_big and len(set(big_rows[0])) == counts[0]
    assert set(big_rows[0]) | set(big_rows[1]) == set(range(n_big))
    plain = stream(table, 1, 0, gbs=1, mbs=1, shuffle=False)
    ordered = [int(table.source[step_rows([plain])[0]]) for _ in range(plain.epoch_size)]
    assert Counter(ordered) == {0: counts[0], 1: counts[1]}
    assert ordered.index(1) <= len(ordered) // counts[1]  # interleaved evenly, not one source after the other


@pytest.mark.parametrize("before, after", [(2, 2), (2, 3), (3, 1)])
def test_mixture_resume_continues_exactly_on_any_world_size(tmp_path, tokenizer, before, after):
    table = table_of(mixture(tmp_path), tokenizer)
    single = stream(table, 1, 0)
    reference = [step_rows([single]) for _ in range(9)]
    old = [stream(table, before, r) for r in range(before)]
    seen = [step_rows(old) for _ in range(4)]
    state = json.loads(json.dumps(old[0].state_dict()))
    new = [stream(table, after, r) for r in range(after)]
    for s in new:
        s.load_state_dict(state)
    seen += [step_rows(new) for _ in range(5)]
    assert seen == reference


def test_mixture_with_eval_fraction_holds_rows_out_of_every_epoch(tmp_path, tokenizer):
    table = table_of(mixture(tmp_path), tokenizer)
    train, held_out, train_rows, eval_rows = split_eval(table, 0.2, seed=5)
    assert torch.equal(train.source, table.source[train_rows]) and train.weights == table.weights
    s = stream(train, 1, 0, gbs=4)
    used = {int(train_rows[r]) for _ in range(10) for r in step_rows([s])}
    assert used.isdisjoint(eval_rows.tolist())


# ---------------------------------------------------------------- the data cache


def test_cache_key_covers_sources_weights_and_file_contents(tmp_path, tokenizer, tok_dir):
    data = mixture(tmp_path)
    key = table_key(data, tok_dir, 0)
    assert table_key(mixture(tmp_path), tok_dir, 0) == key
    assert table_key(mixture(tmp_path, weights=(0.5, 0.5)), tok_dir, 0) != key
    parquet(Path(data.sources[0].path), [{"text": t} for t in reversed(TEXTS)])  # same rows, another order
    changed = table_key(data, tok_dir, 0)
    assert changed != key
    glob = DataSpec(path=str(tmp_path / "*.parquet"))
    before = table_key(glob, tok_dir, 0)
    parquet(tmp_path / "more.parquet", [{"text": "new"}])
    assert table_key(glob, tok_dir, 0) != before


def test_cache_round_trips_a_mixture(tmp_path, tokenizer, tok_dir):
    data = mixture(tmp_path)
    built, cached = load_or_build(data, tok_dir, 0, tmp_path / "cache", is_main=True,
                                  build=lambda: table_of(data, tokenizer))
    again, cached_again = load_or_build(data, tok_dir, 0, tmp_path / "cache", is_main=True, build=None)
    assert (cached, cached_again) == (False, True)
    assert same(again, built) and torch.equal(again.source, built.source) and again.weights == built.weights
