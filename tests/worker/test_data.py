"""Worker data: tokenizer and tiny-model assets, loss masking, packing, and the resumable batch stream."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from fsdpjob.jobs.data import (
    IGNORE,
    BatchStream,
    DataError,
    Example,
    SequenceTable,
    build_sequences,
    count_tokens,
    read_examples,
)
from fsdpjob.jobs.quickstart import ARCHS, build_tiny_model, build_tokenizer, make_quickstart
from fsdpjob.orchestrator.core.inputs.checks import check_inputs
from fsdpjob.orchestrator.core.jobspec.spec import DataSpec, load_spec

CORPUS = ["hello world", "the quick brown fox jumps", "12+345=357", "naïve café 日本語 🎉", "a\tb\nc  d"] * 20
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tok")
    build_tokenizer(out, CORPUS, vocab_size=400)
    return out


@pytest.fixture()
def tokenizer(tok_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tok_dir))


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")
    return path


def turns(*pairs: str) -> list[dict[str, str]]:
    return [{"role": role, "content": content} for role, content in zip(pairs[::2], pairs[1::2])]


def enc(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


# ---------------------------------------------------------------- assets


@pytest.mark.parametrize("text", ["hello", "naïve café 日本語 🎉 Ωmega", "  lead\tand trail  \n\n", "x" * 300, ""])
def test_tokenizer_round_trips_any_text(tokenizer, text):
    assert tokenizer.decode(enc(tokenizer, text)) == text


def test_tokenizer_special_tokens_and_chat_template(tokenizer):
    assert None not in (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id)
    assert len({tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id}) == 3
    messages = turns("system", "S", "user", "U")
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == "<|bos|><|system|>\nS<|eos|><|user|>\nU<|eos|><|assistant|>\n"
    assert len(enc(tokenizer, "<|assistant|>")) == 1


@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_model_builds_and_reloads(tmp_path, arch):
    from transformers import AutoModelForCausalLM

    tokenizer = build_tokenizer(tmp_path / "a", CORPUS, vocab_size=300)
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    build_tiny_model(tmp_path / "a", arch=arch, hidden_size=32, num_layers=2, seed=3)
    assert (tmp_path / "a" / "model.safetensors").is_file()
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "a"))
    assert model.config.model_type == arch and model.config.vocab_size == len(tokenizer)
    assert model.config.pad_token_id == tokenizer.pad_token_id and len(model.model.layers) == 2
    logits = model(input_ids=torch.tensor([[1, 2, 3]])).logits
    assert logits.shape == (1, 3, len(tokenizer))
    # The seed fixes the weights: a rebuild elsewhere is bitwise the same.
    build_tiny_model(tmp_path / "b", arch=arch, vocab_size=len(tokenizer), hidden_size=32, num_layers=2, seed=3)
    again = AutoModelForCausalLM.from_pretrained(str(tmp_path / "b"))
    for (name, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), name


def test_tiny_model_refuses_vocab_mismatch(tok_dir, tmp_path):
    with pytest.raises(ValueError, match="does not match the tokenizer"):
        build_tiny_model(tok_dir, vocab_size=12345)
    with pytest.raises(ValueError, match="has no tokenizer"):
        build_tiny_model(tmp_path)
    with pytest.raises(ValueError, match="not one of"):
        build_tiny_model(tmp_path, arch="gpt2", vocab_size=10)


def test_quickstart_assets_pass_checks_and_loss_falls(tmp_path):
    """The quickstart set is valid input, small, and learnable: 25 AdamW steps more than halve the loss."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    made = make_quickstart(tmp_path / "qs")
    spec_file = tmp_path / "job.yaml"
    spec_file.write_text(
        f"name: qs\nmodel:\n  path: {made['model_path']}\ndata:\n  path: {made['data_path']}\n  seq_len: 128\n"
        "train:\n  max_steps: 10\n"
    )
    spec, doc = load_spec(spec_file)
    check_inputs(spec, doc)
    tokenizer = AutoTokenizer.from_pretrained(made["model_path"])
    table = build_sequences(read_examples(spec.data, tokenizer), 128, True, tokenizer.pad_token_id)
    model = AutoModelForCausalLM.from_pretrained(made["model_path"])
    assert sum(p.numel() for p in model.parameters()) < 3_000_000
    stream = BatchStream(table, seed=0, shuffle=True, micro_batch_size=16, grad_accum_steps=1, dp_rank=0, dp_world=1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95))
    losses = []
    for step in range(25):
        for group in optimizer.param_groups:
            group["lr"] = 3e-3 * min(1.0, (step + 1) / 10)
        (batch,) = stream.next_step().micro_batches
        loss = model(input_ids=batch.input_ids, labels=batch.labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses


# ---------------------------------------------------------------- reading and masking


def test_text_examples_train_on_every_token(tmp_path, tokenizer):
    data = DataSpec(path=str(write_jsonl(tmp_path / "d.jsonl", [{"text": "hello world"}, {"text": "fox"}])))
    first, second = read_examples(data, tokenizer)
    assert first.input_ids == [tokenizer.bos_token_id, *enc(tokenizer, "hello world"), tokenizer.eos_token_id]
    assert first.labels == first.input_ids
    assert (first.source_line, second.source_line) == (1, 2)


def test_prompt_tokens_carry_no_loss(tmp_path, tokenizer):
    rows = [{"q": "12+345=", "a": "357", "other": 1}]
    data = DataSpec(path=str(write_jsonl(tmp_path / "d.jsonl", rows)), prompt_field="q", completion_field="a")
    (example,) = read_examples(data, tokenizer)
    prompt = [tokenizer.bos_token_id, *enc(tokenizer, "12+345=")]
    completion = [*enc(tokenizer, "357"), tokenizer.eos_token_id]
    assert example.input_ids == prompt + completion
    assert example.labels == [IGNORE] * len(prompt) + completion


def test_only_assistant_turns_carry_loss(tmp_path, tokenizer):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Add 2 and 3."},
        {"role": "assistant", "content": "Five."},
        {"role": "user", "content": "And 4 more?"},
        {"role": "assistant", "content": "Nine, café."},
    ]
    data = DataSpec(path=str(write_jsonl(tmp_path / "d.jsonl", [{"messages": messages}])), messages_field="messages")
    (example,) = read_examples(data, tokenizer)
    special = {name: tokenizer.convert_tokens_to_ids(name) for name in ("<|system|>", "<|user|>", "<|assistant|>")}
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    # Special tokens split the rendering, so the pieces tokenize on their own: build the expectation from them.
    ids, labels = [bos], [IGNORE]
    for m in messages:
        newline, content = enc(tokenizer, "\n"), enc(tokenizer, m["content"])
        assert enc(tokenizer, "\n" + m["content"]) == newline + content
        ids += [special[f"<|{m['role']}|>"], *newline, *content, eos]
        target = m["role"] == "assistant"
        labels += [IGNORE] * (1 + len(newline)) + (content + [eos] if target else [IGNORE] * (len(content) + 1))
    assert example.input_ids == ids
    assert example.labels == labels


def test_chat_template_whose_turns_do_not_end_with_eos(tmp_path, tokenizer):
    """ChatML-style: the end-of-turn marker is trained on; an unlabelled eos separates packed examples."""
    tokenizer.chat_template = CHATML
    messages = turns("user", "hi", "assistant", "yo", "user", "x", "assistant", "bye")
    data = DataSpec(path=str(write_jsonl(tmp_path / "d.jsonl", [{"messages": messages}])), messages_field="messages")
    (example,) = read_examples(data, tokenizer)
    assert example.input_ids[-1] == tokenizer.eos_token_id and example.labels[-1] == IGNORE
    trained = [t for t in example.labels if t != IGNORE]
    assert tokenizer.decode(trained) == "yo<|im_end|>\nbye<|im_end|>\n"
    first = example.labels.index(next(t for t in example.labels if t != IGNORE))
    assert tokenizer.decode(example.input_ids[:first]) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_chat_template_that_renders_the_last_turn_differently(tmp_path, tokenizer):
    """When rendering prefixes does not reproduce the full text, the assistant content is located instead."""
    tokenizer.chat_template = (
        "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}"
        "{% if loop.last %} (final){% endif %}{{ eos_token }}{% endfor %}"
    )
    messages = turns("user", "world", "assistant", "world", "user", "q2", "assistant", "world")
    data = DataSpec(path=str(write_jsonl(tmp_path / "d.jsonl", [{"messages": messages}])), messages_field="messages")
    (example,) = read_examples(data, tokenizer)
    # ' world' is one token that starts on the template's space: it is part of the reply, so it is trained on.
    assert len(enc(tokenizer, " world")) == 1
    assert tokenizer.decode([t for t in example.labels if t != IGNORE]) == " world<|eos|> world"


# ---------------------------------------------------------------- bad data, with line numbers


@pytest.mark.parametrize(
    "rows, line, words",
    [
        ([], 1, "the data file is empty"),
        (['{"text": "a"}', "", '{"text": oops}'], 3, "malformed JSON"),
        (['{"text": "a"}', '{"txt": "b"}'], 2, "missing field 'text'"),
        (['{"text": ["a"]}'], 1, "expected a string, found an array"),
        (['"just a string"'], 1, "expected a JSON object"),
    ],
)
def test_bad_text_data(tmp_path, tokenizer, rows, line, words):
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    with pytest.raises(DataError) as info:
        read_examples(DataSpec(path=str(path)), tokenizer)
    assert (info.value.file, info.value.line) == (str(path), line)
    assert str(info.value).startswith(f"{path}:{line}: ") and words in str(info.value)


def test_bad_chat_data(tmp_path, tokenizer):
    good = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}
    path = write_jsonl(tmp_path / "d.jsonl", [good, {"messages": [{"role": "user"}]}])
    with pytest.raises(DataError, match=r":2: field 'messages': message 0 has no 'content'"):
        read_examples(DataSpec(path=str(path), messages_field="messages"), tokenizer)
    tokenizer.chat_template = (
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}"
        "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    )
    path = write_jsonl(tmp_path / "d.jsonl", [good, {"messages": [{"role": "assistant", "content": "b"}]}])
    with pytest.raises(DataError, match=r":2: the chat template rejected this conversation: user first"):
        read_examples(DataSpec(path=str(path), messages_field="messages"), tokenizer)
    tokenizer.chat_template = None
    with pytest.raises(DataError, match=r":1: the tokenizer has no chat template"):
        read_examples(DataSpec(path=str(path), messages_field="messages"), tokenizer)


def test_missing_data_file(tmp_path, tokenizer):
    with pytest.raises(DataError, match="data file not found"):
        read_examples(DataSpec(path=str(tmp_path / "nope.jsonl")), tokenizer)


# ---------------------------------------------------------------- sequences


def examples(n: int, length: int = 5) -> list[Example]:
    out = []
    for i in range(n):
        ids = list(range(100 * i, 100 * i + length + i % 3))
        out.append(Example(ids, [IGNORE] + ids[1:], i + 1))
    return out


def test_naive_packing_concatenates_and_pads_only_the_tail():
    exs = examples(7)
    table = build_sequences(exs, 8, "naive", pad_id=0)
    flat_ids = [t for e in exs for t in e.input_ids]
    flat_labels = [t for e in exs for t in e.labels]
    rows = -(-len(flat_ids) // 8)
    assert table.input_ids.shape == table.labels.shape == (rows, 8)
    assert table.input_ids.flatten()[: len(flat_ids)].tolist() == flat_ids
    assert table.labels.flatten()[: len(flat_labels)].tolist() == flat_labels
    assert set(table.labels.flatten()[len(flat_labels):].tolist()) <= {IGNORE}
    again = build_sequences(exs, 8, "naive", pad_id=0)
    assert torch.equal(table.input_ids, again.input_ids) and torch.equal(table.labels, again.labels)


def test_no_packing_truncates_and_pads_each_example():
    exs = examples(4, length=6)
    table = build_sequences(exs, 7, False, pad_id=-1)
    assert table.input_ids.shape == (4, 7) and table.truncated == 1  # only example 2 (8 tokens) is cut
    for row, example in enumerate(exs):
        n = min(7, len(example.input_ids))
        assert table.input_ids[row, :n].tolist() == example.input_ids[:n]
        assert table.input_ids[row, n:].tolist() == [-1] * (7 - n)
        assert table.labels[row, n:].tolist() == [IGNORE] * (7 - n)


def test_count_tokens_skips_position_zero_and_masked():
    labels = torch.tensor([[5, 6, IGNORE, 7], [IGNORE, IGNORE, 8, IGNORE]])
    assert count_tokens(labels) == 3


# ---------------------------------------------------------------- batch stream


def table_of(n: int) -> SequenceTable:
    ids = torch.arange(n).unsqueeze(1).repeat(1, 4)  # row i holds the value i: batches show which rows they got
    return SequenceTable(ids, ids.clone(), n, 0)


def stream(table, world: int, rank: int, *, gbs: int = 12, mbs: int = 2, seed: int = 7, shuffle: bool = True):
    """Rank ``rank`` of ``world`` with global batch ``gbs``: grad_accum_steps makes up the rest, as on resume."""
    accum = gbs // (mbs * world)
    return BatchStream(table, seed=seed, shuffle=shuffle, micro_batch_size=mbs, grad_accum_steps=accum,
                       dp_rank=rank, dp_world=world)  # fmt: skip


def step_samples(streams: list[BatchStream]) -> tuple[list[int], list[int]]:
    """One step on every rank: (sorted global positions, sorted rows) of the whole global batch."""
    batches = [mb for s in streams for mb in s.next_step().micro_batches]
    for mb in batches:
        assert torch.equal(mb.input_ids[:, 0], mb.sequence_ids) and mb.input_ids.shape == (2, 4)
    positions = torch.cat([mb.sample_ids for mb in batches]).tolist()
    return sorted(positions), sorted(torch.cat([mb.sequence_ids for mb in batches]).tolist())


def step_batches(streams: list[BatchStream]) -> list[tuple[list[int], list[int]]]:
    """One step on every rank: (positions, rows) of each micro-batch, in rank order."""
    steps = [s.next_step() for s in streams]
    return [(mb.sample_ids.tolist(), mb.sequence_ids.tolist()) for step in steps for mb in step.micro_batches]


def test_every_rank_counts_the_global_batch_target_tokens_itself():
    # Row i has i % 5 masked labels (position 0 is never a target), so rows count differently; G = 12 > N = 10,
    # so steps straddle epochs. What each rank computes alone must be what a sum over the ranks gives.
    ids = torch.arange(10).unsqueeze(1).repeat(1, 6)
    labels = ids.clone()
    for i in range(10):
        labels[i, 6 - i % 5 :] = IGNORE
    table = SequenceTable(ids, labels, 10, 0)
    for world in (1, 2, 3):
        streams = [stream(table, world, r) for r in range(world)]
        for _ in range(4):
            steps = [s.next_step() for s in streams]
            summed = sum(count_tokens(mb.labels) for step in steps for mb in step.micro_batches)
            assert {step.tokens for step in steps} == {summed}
            assert 0 < summed < 12 * 5


def test_every_world_size_sees_the_same_samples_per_step():
    table = table_of(10)  # G = 12 > N, so steps straddle epoch boundaries
    runs = {w: [stream(table, w, r) for r in range(w)] for w in (1, 2, 3, 6)}
    for step in range(6):
        results = {w: step_samples(ss) for w, ss in runs.items()}
        assert results[1][0] == list(range(12 * step, 12 * (step + 1)))
        assert all(r == results[1] for r in results.values()), results


def test_each_epoch_is_a_seeded_permutation():
    table = table_of(10)
    s = stream(table, 1, 0, gbs=2)
    order = [x for _ in range(10) for mb in s.next_step().micro_batches for x in mb.sequence_ids.tolist()]
    epoch0, epoch1 = order[:10], order[10:]
    assert sorted(epoch0) == sorted(epoch1) == list(range(10)) and epoch0 != epoch1
    same = stream(table, 1, 0, gbs=2)
    assert [x for _ in range(10) for mb in same.next_step().micro_batches for x in mb.sequence_ids.tolist()] == order
    other = stream(table, 1, 0, gbs=2, seed=8)
    assert [x for _ in range(10) for mb in other.next_step().micro_batches for x in mb.sequence_ids.tolist()] != order
    plain = stream(table, 1, 0, gbs=2, shuffle=False)
    seen = [x for _ in range(10) for mb in plain.next_step().micro_batches for x in mb.sequence_ids.tolist()]
    assert seen == list(range(10)) * 2


def test_resume_mid_run_continues_exactly():
    table = table_of(23)
    reference = [stream(table, 2, r) for r in range(2)]
    expected = [step_batches(reference) for _ in range(8)]
    first = [stream(table, 2, r) for r in range(2)]
    for _ in range(3):
        for s in first:
            s.next_step()
    states = [s.state_dict() for s in first]
    assert states[0] == states[1] == {"samples_consumed": 36, "seed": 7, "num_sequences": 23, "packing": "boundary"}
    resumed = [stream(table, 2, r) for r in range(2)]
    for s, state in zip(resumed, states):
        s.load_state_dict(json.loads(json.dumps(state)))
    got = [step_batches(resumed) for _ in range(5)]
    assert got == expected[3:]


@pytest.mark.parametrize("before, after", [(2, 1), (2, 3), (3, 2), (1, 6)])
def test_no_sample_skipped_or_repeated_when_the_world_changes(before, after):
    table = table_of(17)
    single = stream(table, 1, 0)
    reference = [step_samples([single]) for _ in range(7)]
    old = [stream(table, before, r) for r in range(before)]
    seen = [step_samples(old) for _ in range(3)]
    state = old[0].state_dict()
    new = [stream(table, after, r) for r in range(after)]
    for s in new:
        s.load_state_dict(state)
    seen += [step_samples(new) for _ in range(4)]
    assert seen == reference
    positions = [p for positions, _ in seen for p in positions]
    assert positions == list(range(7 * 12))


def test_refuses_state_from_other_data_or_seed():
    table = table_of(10)
    s = stream(table, 1, 0)
    with pytest.raises(ValueError, match="had 11 sequences, this run has 10"):
        s.load_state_dict({"samples_consumed": 12, "seed": 7, "num_sequences": 11, "packing": "boundary"})
    with pytest.raises(ValueError, match="seed 3"):
        s.load_state_dict({"samples_consumed": 12, "seed": 3, "num_sequences": 10, "packing": "boundary"})
    with pytest.raises(ValueError, match="dp_rank 2"):
        BatchStream(table, seed=0, shuffle=True, micro_batch_size=1, grad_accum_steps=1, dp_rank=2, dp_world=2)
