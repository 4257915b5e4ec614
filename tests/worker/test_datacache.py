"""The run's data cache: the first start tokenizes and rank 0 saves the packed table; later starts read
it back bit for bit; any change to the data, the tokenizer or the data settings, or a damaged file,
means tokenizing again."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fsdpjob.jobs.data import build_sequences, read_examples
from fsdpjob.jobs.data.cache import load_or_build
from fsdpjob.jobs.quickstart import make_quickstart
from fsdpjob.orchestrator.core.jobspec.spec import DataSpec


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> dict:
    return make_quickstart(tmp_path_factory.mktemp("assets"))


class Builder:
    """build() for load_or_build that counts its calls (each one is a full tokenization)."""

    def __init__(self, data: DataSpec, model_path: str):
        from transformers import AutoTokenizer

        self.data, self.tokenizer, self.calls = data, AutoTokenizer.from_pretrained(model_path), 0

    def __call__(self):
        self.calls += 1
        return build_sequences(read_examples(self.data, self.tokenizer), self.data.seq_len, self.data.packing, 0)


def load(data: DataSpec, assets: dict, cache: Path, is_main: bool = True):
    builder = Builder(data, assets["model_path"])
    table, cached = load_or_build(data, assets["model_path"], 0, cache, is_main=is_main, build=builder)
    return table, cached, builder.calls


def test_second_start_reads_the_same_table_without_tokenizing(assets, tmp_path):
    data = DataSpec(path=assets["data_path"], seq_len=32)
    first, cached1, calls1 = load(data, assets, tmp_path)
    second, cached2, calls2 = load(data, assets, tmp_path)
    assert (cached1, calls1, cached2, calls2) == (False, 1, True, 0)
    assert torch.equal(first.input_ids, second.input_ids) and torch.equal(first.labels, second.labels)
    assert (first.num_examples, first.truncated) == (second.num_examples, second.truncated)
    assert len(list(tmp_path.glob("sequences-*.safetensors"))) == 1 and not list(tmp_path.glob(".*tmp*"))


def test_only_the_main_rank_writes(assets, tmp_path):
    data = DataSpec(path=assets["data_path"], seq_len=32)
    load(data, assets, tmp_path, is_main=False)
    assert not tmp_path.exists() or not list(tmp_path.iterdir())


def test_changed_settings_data_or_tokenizer_tokenize_again(assets, tmp_path):
    data = DataSpec(path=assets["data_path"], seq_len=32)
    load(data, assets, tmp_path / "cache")
    assert load(DataSpec(path=assets["data_path"], seq_len=64), assets, tmp_path / "cache")[1] is False
    # The data file's bytes are part of the key (not its name or mtime).
    edited = tmp_path / "edited.jsonl"
    lines = Path(assets["data_path"]).read_text().splitlines()
    edited.write_text("\n".join(lines[:-1] + [json.dumps({"text": "one changed line"})]) + "\n")
    assert load(DataSpec(path=str(edited), seq_len=32), assets, tmp_path / "cache")[1] is False
    # So are the tokenizer's files in the model folder.
    cfg = Path(assets["model_path"]) / "tokenizer_config.json"
    original = cfg.read_text()
    try:
        cfg.write_text(json.dumps({**json.loads(original), "model_max_length": 12345}))
        assert load(data, assets, tmp_path / "cache")[1] is False
    finally:
        cfg.write_text(original)
    assert len(list((tmp_path / "cache").glob("sequences-*.safetensors"))) == 1  # stale tables are removed


@pytest.mark.parametrize("damage", ["truncate", "garbage", "empty"])
def test_damaged_cache_is_rebuilt_not_trusted(assets, tmp_path, damage):
    data = DataSpec(path=assets["data_path"], seq_len=32)
    good, _, _ = load(data, assets, tmp_path)
    (path,) = tmp_path.glob("sequences-*.safetensors")
    blob = path.read_bytes()
    path.write_bytes({"truncate": blob[: len(blob) // 2], "garbage": b"\x07" * 64, "empty": b""}[damage])
    table, cached, calls = load(data, assets, tmp_path)
    assert (cached, calls) == (False, 1) and torch.equal(table.input_ids, good.input_ids)
    assert load(data, assets, tmp_path)[1] is True  # and the rebuilt cache is good again
