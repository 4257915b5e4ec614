"""Boundary-aware packing: whole examples per row, each attending only to itself, in real tiny models of the
families that take it; long examples; the loss and eval loss of packed rows; the packing mode a checkpoint keeps."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from distributed import free_port
from families import VOCAB, save_tiny_family

from fsdpjob.jobs.data import (
    IGNORE,
    BatchStream,
    Example,
    best_fit_rows,
    build_sequences,
    count_tokens,
    eval_batches,
    micro_batch,
)
from fsdpjob.jobs.step import eval_loss, forward_logits, train_step
from fsdpjob.orchestrator.core.jobspec.spec import DataSpec

# Sliding windows shorter than the examples, so the window and the example boundary both cut the mask.
WINDOWED = {
    "mistral": dict(sliding_window=4),
    "gemma2": dict(sliding_window=4),
    "qwen2": dict(use_sliding_window=True, sliding_window=4, max_window_layers=0),
}
PACKED_FAMILIES = ("llama", "mistral", "qwen2", "gemma2", "gpt2")
SEQ = 32


def chat_like(n: int, seed: int = 0) -> list[Example]:
    """Examples of 3..20 tokens, each a prompt (no loss) and a reply."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length = int(torch.randint(3, 21, (1,), generator=gen))
        ids = torch.randint(3, VOCAB, (length,), generator=gen).tolist()
        prompt = length // 3
        out.append(Example(ids, [IGNORE] * prompt + ids[prompt:], i + 1))
    return out


def segments(row_positions: torch.Tensor, length: int) -> list[tuple[int, int]]:
    """(start, end) of each example in a boundary-packed row: where its positions restart at 0."""
    starts = [i for i in range(length) if row_positions[i] == 0] + [length]
    return list(zip(starts[:-1], starts[1:]))


# ---------------------------------------------------------------- the table


def test_best_fit_fills_rows_with_whole_examples_and_is_deterministic():
    lengths = [30, 3, 17, 9, 12, 1, 32, 16, 5, 8, 20, 14]
    rows = best_fit_rows(lengths, 32)
    assert sorted(i for row in rows for i in row) == list(range(len(lengths)))  # each example once, whole
    assert all(sum(lengths[i] for i in row) <= 32 for row in rows)
    assert len(rows) == -(-sum(lengths) // 32)  # as few rows as the tokens need here
    assert best_fit_rows(lengths, 32) == rows


def test_boundary_rows_restart_positions_and_ignore_each_first_target():
    exs = chat_like(40)
    table = build_sequences(exs, SEQ, True, pad_id=0)
    assert table.position_ids is not None and table.num_examples == 40
    placed = []
    for r in range(len(table)):
        n = int(table.lengths[r])
        assert table.input_ids[r, n:].eq(0).all() and table.labels[r, n:].eq(IGNORE).all()
        for start, end in segments(table.position_ids[r], n):
            ids = table.input_ids[r, start:end].tolist()
            match = next(e for e in exs if e.input_ids == ids)  # a whole example, never a part
            assert table.labels[r, start] == IGNORE  # predicted from the previous example's last token
            assert table.labels[r, start + 1 : end].tolist() == match.labels[1:]
            assert table.position_ids[r, start:end].tolist() == list(range(end - start))
            placed.append(match.source_line)
    assert sorted(placed) == list(range(1, 41))
    total = sum(len(e.input_ids) for e in exs)
    assert table.efficiency == pytest.approx(total / (len(table) * SEQ))
    assert table.efficiency > 0.9  # best fit leaves little padding on spread-out lengths
    # The same target tokens as one example per row (where position 0 is never a target either).
    assert count_tokens(table.labels) == count_tokens(build_sequences(exs, SEQ, False, pad_id=0).labels)


def test_long_examples_truncate_split_or_drop():
    exs = [Example(list(range(3, 3 + n)), list(range(3, 3 + n)), i + 1) for i, n in enumerate((10, 70, 20, 33))]
    cut = build_sequences(exs, SEQ, True, 0)
    assert (cut.truncated, cut.split, cut.dropped) == (2, 0, 0)
    assert int(cut.lengths.sum()) == 10 + 32 + 20 + 32
    split = build_sequences(exs, SEQ, True, 0, "split")
    assert (split.truncated, split.split, split.dropped) == (0, 2, 0)
    assert int(split.lengths.sum()) == 10 + 70 + 20 + 33  # nothing lost
    chunks = [split.input_ids[r, s:e].tolist() for r in range(len(split))
              for s, e in segments(split.position_ids[r], int(split.lengths[r]))]
    assert list(range(3 + 32, 3 + 64)) in chunks and list(range(3 + 64, 3 + 70)) in chunks  # own positions each
    dropped = build_sequences(exs, SEQ, True, 0, "drop")
    assert (dropped.truncated, dropped.split, dropped.dropped) == (0, 0, 2)
    assert int(dropped.lengths.sum()) == 30
    one_per_row = build_sequences(exs, SEQ, False, 0, "split")
    assert len(one_per_row) == 1 + 3 + 1 + 2 and one_per_row.split == 2
    with pytest.raises(ValueError, match="long_examples is drop"):
        build_sequences(exs[1:2], SEQ, True, 0, "drop")


def test_spec_takes_the_three_modes_and_refuses_long_examples_with_naive(tmp_path):
    assert DataSpec(path="d.jsonl").packing is True and DataSpec(path="d.jsonl").long_examples == "truncate"
    assert DataSpec(path="d.jsonl", packing="naive").packing == "naive"
    with pytest.raises(ValueError, match="long_examples applies to packing true or false"):
        DataSpec(path="d.jsonl", packing="naive", long_examples="split")
    with pytest.raises(ValueError):
        DataSpec(path="d.jsonl", packing="boundary")


# ---------------------------------------------------------------- each example sees only itself


def tiny_model(tmp_path: Path, family: str):
    from transformers import AutoModelForCausalLM

    save_tiny_family(tmp_path / family, family, **WINDOWED.get(family, {}))
    # gemma2 has no sdpa path in transformers 5.24: eager, as the worker would run it.
    impl = "eager" if family == "gemma2" else "sdpa"
    return AutoModelForCausalLM.from_pretrained(tmp_path / family, attn_implementation=impl,
                                                dtype=torch.float32).eval()


def rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("family", PACKED_FAMILIES)
def test_each_packed_example_gives_the_logits_it_gives_alone(tmp_path, family):
    model = tiny_model(tmp_path, family)
    exs = chat_like(12, seed=1)
    table = build_sequences(exs, SEQ, True, pad_id=0)
    rows = torch.arange(len(table))
    batch = micro_batch(table, rows, rows)
    with torch.no_grad():
        packed = forward_logits(model, batch.input_ids, batch.position_ids, torch.device("cpu"))
        # The rows flattened into one, as flash_attention_2's varlen path takes them: the same logits.
        flat = forward_logits(model, batch.input_ids, batch.position_ids, torch.device("cpu"), flatten=True)
        assert rel_error(flat, packed) <= 1e-5
        checked = 0
        for r in range(len(table)):
            for start, end in segments(table.position_ids[r], int(table.lengths[r])):
                alone = model(input_ids=table.input_ids[r : r + 1, start:end], use_cache=False).logits[0]
                assert rel_error(packed[r, start:end], alone) <= 1e-5, (family, r, start)
                checked += 1
        assert checked == 12
        # The check can fail: naive rows (concatenated, no boundaries) give other logits for later examples.
        naive = build_sequences(exs, 2 * SEQ, "naive", pad_id=0)  # the first two examples whole in row 0
        logits = model(input_ids=naive.input_ids[:1], use_cache=False).logits[0]
        second = exs[1].input_ids
        start = len(exs[0].input_ids)
        alone = model(input_ids=torch.tensor([second]), use_cache=False).logits[0]
        assert rel_error(logits[start : start + len(second)], alone) > 1e-2


VARLEN_FAMILIES = ("llama", "qwen2", "gpt2", "phi3")  # plain causal attention (no window, no soft-capping)


@pytest.mark.parametrize("family", VARLEN_FAMILIES)
def test_varlen_attention_gets_the_boundaries_once_and_gives_each_example_its_own_logits(tmp_path, family, monkeypatch):
    """The default GPU path for packed batches (model.attn_implementation auto -> varlen): the rows go in as one,
    the boundaries computed on the host reach every attention call as transformers' varlen kwargs, and no mask
    is built; the logits equal each example's alone. On CPU the same function runs SDPA per example."""
    from transformers import AutoModelForCausalLM

    from fsdpjob.jobs.model import varlen
    from fsdpjob.jobs.model.build import resolve_attention

    save_tiny_family(tmp_path / family, family)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / family, attn_implementation="sdpa",
                                                 dtype=torch.float32).eval()
    # Explicitly asked for, varlen runs on CPU too; auto keeps sdpa there (no dense-mask cost worth avoiding).
    assert resolve_attention(model.config, "varlen", device=torch.device("cpu"), packed=True,
                             mixed_precision="fp32") == varlen.NAME
    assert resolve_attention(model.config, "auto", device=torch.device("cpu"), packed=True,
                             mixed_precision="bf16") == "sdpa"
    model.set_attn_implementation(varlen.NAME)
    seen = []
    real = varlen.attention

    def spy(module, query, key, value, attention_mask, **kwargs):
        seen.append((attention_mask, kwargs["cu_seq_lens_q"], kwargs["max_length_q"]))
        return real(module, query, key, value, attention_mask, **kwargs)

    monkeypatch.setattr(varlen, "attention", spy)
    varlen.register()
    table = build_sequences(chat_like(12, seed=2), SEQ, True, pad_id=0)
    rows = torch.arange(len(table))
    batch = micro_batch(table, rows, rows)
    with torch.no_grad():
        packed = forward_logits(model, batch.input_ids, batch.position_ids, torch.device("cpu"))
        assert len(seen) == model.config.num_hidden_layers  # one call per layer, every one with the kwargs
        cu = seen[0][1]
        assert all(mask is None and c is cu and m == SEQ for mask, c, m in seen)  # the same host-made tensor
        starts = [int(x) for x in cu[:-1]]
        assert starts == [i for i, p in enumerate(batch.position_ids.reshape(-1).tolist()) if p == 0]
        checked = 0
        for r in range(len(table)):
            for start, end in segments(table.position_ids[r], int(table.lengths[r])):
                alone = model(input_ids=table.input_ids[r : r + 1, start:end], use_cache=False,
                              **varlen.model_kwargs(varlen.seq_lens(torch.arange(end - start)[None]),
                                                    torch.device("cpu"))).logits[0]
                assert rel_error(packed[r, start:end], alone) <= 1e-5, (family, r, start)
                checked += 1
        assert checked == 12
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        dense = forward_logits(model, batch.input_ids, batch.position_ids, torch.device("cpu"))
    assert rel_error(packed, dense) <= 1e-5  # and the same as transformers' dense-mask path


def test_varlen_attention_refuses_what_it_does_not_implement():
    from fsdpjob.jobs.model import varlen

    q = torch.zeros(1, 2, 4, 8)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match="sliding_window"):
        varlen.attention(None, q, q, q, None, cu_seq_lens_q=cu, max_length_q=4, sliding_window=2)
    with pytest.raises(ValueError, match="cu_seq_lens"):
        varlen.attention(None, q, q, q, None)
    with pytest.raises(ValueError, match="dropout"):
        varlen.attention(None, q, q, q, None, dropout=0.1, cu_seq_lens_q=cu, max_length_q=4)


# ---------------------------------------------------------------- loss and eval loss


@pytest.fixture()
def one_rank():
    """A process group of one gloo rank, as train_step and eval_loss reduce over the ranks."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def example_loss_sums(model, exs: list[Example]) -> tuple[float, int]:
    """Summed token loss and target tokens of the examples, each run alone."""
    total, tokens = 0.0, 0
    with torch.no_grad():
        for e in exs:
            logits = model(input_ids=torch.tensor([e.input_ids]), use_cache=False).logits[0, :-1]
            targets = torch.tensor(e.labels[1:])
            total += float(torch.nn.functional.cross_entropy(logits, targets, ignore_index=IGNORE, reduction="sum"))
            tokens += int((targets != IGNORE).sum())
    return total, tokens


def test_packed_step_loss_is_the_token_weighted_loss_of_its_examples(tmp_path, one_rank):
    model = tiny_model(tmp_path, "llama").train()
    exs = chat_like(16, seed=2)
    table = build_sequences(exs, SEQ, True, pad_id=0)
    # One pass over the table in one step: every row once.
    stream = BatchStream(table, seed=0, shuffle=False, micro_batch_size=1, grad_accum_steps=len(table),
                         dp_rank=0, dp_world=1)
    step = stream.next_step()
    expected, tokens = example_loss_sums(model, exs)
    assert step.tokens == tokens and step.processed == int(table.lengths.sum()) < len(table) * SEQ
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    values = train_step(model, optimizer, step.micro_batches, torch.device("cpu"), tokens=step.tokens,
                        max_grad_norm=1.0, processed=step.processed)
    assert values.loss == pytest.approx(expected / tokens, rel=1e-5)
    assert values.processed == step.processed


def test_eval_loss_is_the_same_packed_and_unpacked(tmp_path, one_rank):
    model = tiny_model(tmp_path, "qwen2")
    exs = chat_like(20, seed=3)
    results = {}
    for packing in (True, False):
        table = build_sequences(exs, SEQ, packing, pad_id=0)
        batches = eval_batches(table, micro_batch_size=3, max_batches=0, dp_rank=0, dp_world=1)
        results[packing] = eval_loss(model, batches, torch.device("cpu"))
    (packed, packed_tokens), (unpacked, unpacked_tokens) = results[True], results[False]
    assert packed_tokens == unpacked_tokens == example_loss_sums(model, exs)[1]
    assert packed == pytest.approx(unpacked, rel=1e-5)


# ---------------------------------------------------------------- the mode a checkpoint keeps


def stream_of(packing: str) -> BatchStream:
    table = build_sequences(chat_like(8), SEQ, packing != "none", pad_id=0) if packing != "naive" else \
        build_sequences(chat_like(8), SEQ, "naive", pad_id=0)
    return BatchStream(table, seed=0, shuffle=True, micro_batch_size=1, grad_accum_steps=1, dp_rank=0, dp_world=1,
                       packing=packing)


def test_a_resume_with_another_packing_mode_is_refused(tmp_path):
    from ckpt_driver import manager

    from fsdpjob.jobs.checkpoint import step_dir_name
    from fsdpjob.jobs.checkpoint.state import DictState

    ckpt = manager(tmp_path, 0, 1)
    saved = stream_of("boundary")
    saved.next_step()
    ckpt.save(1, {"data": DictState(saved, optional=BatchStream.ADDED)}, reason="stop")
    ckpt.wait()
    same = stream_of("boundary")
    ckpt.load(tmp_path / step_dir_name(1), {"data": DictState(same, optional=BatchStream.ADDED)})
    assert same.samples_consumed == 1
    changed = stream_of("naive")
    changed.table = same.table  # the same row count: only the mode differs
    with pytest.raises(Exception, match=r"packed its data as true \(boundary-aware\).*Set data.packing back to true"):
        ckpt.load(tmp_path / step_dir_name(1), {"data": DictState(changed, optional=BatchStream.ADDED)})
    ckpt.close()


def test_a_checkpoint_from_before_the_record_resumes_as_naive(tmp_path):
    from ckpt_driver import manager

    from fsdpjob.jobs.checkpoint import step_dir_name
    from fsdpjob.jobs.checkpoint.state import DictState

    naive = stream_of("naive")

    class Before:  # the data state as checkpoints from before the packing record hold it
        def state_dict(self) -> dict:
            return {"samples_consumed": 3, "seed": 0, "num_sequences": len(naive.table)}

    ckpt = manager(tmp_path, 0, 1)
    ckpt.save(3, {"data": DictState(Before())}, reason="stop")
    ckpt.wait()
    ckpt.load(tmp_path / step_dir_name(3), {"data": DictState(naive, optional=BatchStream.ADDED)})
    assert naive.samples_consumed == 3
    boundary = stream_of("boundary")
    boundary.table = naive.table
    with pytest.raises(Exception, match=r"packed its data as naive .*Set data.packing back to naive"):
        ckpt.load(tmp_path / step_dir_name(3), {"data": DictState(boundary, optional=BatchStream.ADDED)})
    ckpt.close()


def test_the_mfu_attention_term_counts_the_packed_examples_own_lengths(tmp_path):
    """Issue 54, also found: causal attention over a packed example of length L costs L^2, not L x seq_len; the MFU
    counts the tokens' mean context sum(L^2) / sum(L) over what attention sees whole (each example with boundary
    packing, each row's real part unpacked, the whole row with naive packing)."""
    from transformers import LlamaConfig

    from fsdpjob.jobs.report.metrics import model_flops_per_token

    exs = [Example(list(range(3, 3 + n)), list(range(3, 3 + n)), i + 1) for i, n in enumerate((8, 5, 3, 20))]
    packed = build_sequences(exs, 32, True, pad_id=0)
    assert packed.attention_context() == pytest.approx((64 + 25 + 9 + 400) / 36)
    unpacked = build_sequences(exs, 32, False, pad_id=0)  # one example per row, padded
    assert unpacked.attention_context() == pytest.approx((64 + 25 + 9 + 400) / 36)
    naive = build_sequences(exs * 4, 32, "naive", pad_id=0)  # rows attend across examples: the row is the context
    assert 24 < naive.attention_context() <= 32
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    short, full = (model_flops_per_token(config, seq_len=s) for s in (packed.attention_context(), 32))
    assert short < full and full - short == pytest.approx(2 * 3 * 2 * 32 * (32 - 498 / 36))  # 3 x forward's term
