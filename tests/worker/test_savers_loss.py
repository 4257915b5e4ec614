"""train.loss: chunked (jobs/model/chunkedloss.py) on 2 gloo ranks with FSDP2: the standard loss and gradients
within fp32 summation order (plain, tied embeddings, LoRA, boundary-aware packing in rows and flattened, bf16
compute), a lower peak at a large vocabulary, auto read from the plan's worker facts, and the refusals."""

from __future__ import annotations

import resource
from pathlib import Path

import pytest
import torch
from distributed import run_ranks

from fsdpjob.jobs.step import loss_chunk_tokens
from fsdpjob.orchestrator.core.jobspec.modelspec import LoraSpec
from fsdpjob.orchestrator.core.jobspec.spec import TrainSpec

pytestmark = pytest.mark.distributed

VOCAB, SEQ, ROWS = 256, 24, 2  # ROWS per rank


def save_model(path: Path, *, vocab: int = VOCAB, **config) -> Path:
    from transformers import AutoModelForCausalLM

    from fsdpjob.jobs.quickstart import tiny_config

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tiny_config("llama", vocab_size=vocab, **config)).save_pretrained(path)
    return path


def load(path: Path, env, *, mixed_precision: str = "fp32", **options):
    from fsdpjob.jobs.model.build import load_model
    from fsdpjob.jobs.model.parallelize import build_mesh

    return load_model(path, env=env, mesh=build_mesh(env, 1), dtype=torch.float32, attn_implementation="sdpa",
                      mixed_precision=mixed_precision, reshard_after_forward=True, activation_checkpointing=False,
                      cpu_offload=False, **options)


def batch(rank: int, *, packed: bool, vocab: int = VOCAB, seq: int = SEQ, rows: int = ROWS):
    """This rank's rows: random ids, a prompt of 5 tokens masked, and (packed) two examples per row."""
    gen = torch.Generator().manual_seed(100 + rank)
    ids = torch.randint(0, vocab, (rows, seq), generator=gen)
    labels = ids.clone()
    labels[:, :5] = -100
    positions = None
    if packed:
        cut = seq // 2 - 3
        positions = torch.cat([torch.arange(cut), torch.arange(seq - cut)]).repeat(rows, 1)
        labels[:, cut : cut + 2] = -100  # the second example's prompt
    return ids, labels, positions


CASES = {  # name: (model folder, load_model options, packed, flatten, chunk tokens)
    "plain": ("untied", {}, False, None, 5),
    "one_chunk": ("untied", {}, False, None, 4096),
    "tied": ("tied", {}, False, None, 7),
    "lora": ("untied", {"lora": LoraSpec(r=4, alpha=8)}, False, None, 5),
    "packed_rows": ("untied", {}, True, False, 5),
    "packed_flat": ("untied", {}, True, True, 11),
    "bf16": ("untied", {"mixed_precision": "bf16"}, False, None, 5),
}


def _loss_and_grads(model, ids, labels, positions, *, chunk_tokens: int, flatten) -> tuple[float, dict]:
    from fsdpjob.jobs.step import token_loss_sum

    loss = token_loss_sum(model, ids, labels, positions, torch.device("cpu"), chunk_tokens=chunk_tokens,
                          flatten=flatten)
    loss.backward()
    grads = {n: p.grad.full_tensor().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.item(), grads


def _equivalence(rank: int, world_size: int, folders: dict[str, Path]) -> dict:
    from fsdpjob.jobs.dist import close_distributed, init_distributed

    env = init_distributed(120)
    out = {}
    for name, (folder, options, packed, flatten, chunk) in CASES.items():
        model = load(folders[folder], env, **options)
        ids, labels, positions = batch(rank, packed=packed)
        standard, grads = _loss_and_grads(model, ids, labels, positions, chunk_tokens=0, flatten=flatten)
        chunked, chunked_grads = _loss_and_grads(model, ids, labels, positions, chunk_tokens=chunk, flatten=flatten)
        assert grads.keys() == chunked_grads.keys() and grads, name
        worst = max(float((chunked_grads[n] - g).abs().max() / g.abs().max().clamp_min(1e-30))
                    for n, g in grads.items())
        out[name] = {"loss": (standard, chunked), "grad_rel": worst, "params": sorted(grads),
                     "tied": model.lm_head.weight is model.model.embed_tokens.weight}
    close_distributed()
    return out


@pytest.fixture(scope="module")
def equivalence(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("chunked")
    folders = {"untied": save_model(tmp / "untied"), "tied": save_model(tmp / "tied", tie_word_embeddings=True)}
    results = run_ranks(_equivalence, 2, timeout=600, folders=folders)
    return results[0]


@pytest.mark.parametrize("case", [c for c in CASES if c != "bf16"])
def test_chunked_loss_gives_the_standard_loss_and_gradients_in_fp32(equivalence, case):
    result = equivalence[case]
    standard, chunked = result["loss"]
    assert abs(chunked - standard) <= 1e-6 * abs(standard), result["loss"]
    assert result["grad_rel"] <= 1e-5, result["grad_rel"]


def test_chunked_loss_reaches_the_tied_weight_and_only_the_adapters_with_lora(equivalence):
    assert equivalence["tied"]["tied"] and not equivalence["plain"]["tied"]
    assert "lm_head.weight" not in equivalence["tied"]["params"]  # one parameter: the embedding's, both uses
    assert all(".lora_" in n for n in equivalence["lora"]["params"]), equivalence["lora"]["params"][:3]


def test_chunked_loss_with_bf16_compute_is_close(equivalence):
    standard, chunked = equivalence["bf16"]["loss"]
    assert abs(chunked - standard) <= 1e-3 * abs(standard) and equivalence["bf16"]["grad_rel"] <= 2e-2


# ---------------------------------------------------------------- the peak


BIG_VOCAB, BIG_SEQ = 32000, 512


def _step_peak(rank: int, world_size: int, path: Path, chunk_tokens: int) -> dict:
    """The rise of this fresh process's high-water mark (ru_maxrss) over one training step, in MiB: the step's
    activations, logits and their gradients. A step on 16 tokens first pays what a first step costs whatever its
    size (lazy initialisation, thread pools, the optimizer's states: ~340 MiB here, more than the logits)."""
    from fsdpjob.jobs.data import MicroBatch
    from fsdpjob.jobs.dist import close_distributed, init_distributed
    from fsdpjob.jobs.step import train_step

    env = init_distributed(120)
    model = load(path, env)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids, labels, _ = batch(rank, packed=False, vocab=BIG_VOCAB, seq=BIG_SEQ)
    mb = MicroBatch(ids, labels, torch.arange(ROWS), torch.arange(ROWS))
    warm = MicroBatch(ids[:, :8], labels[:, :8], torch.arange(ROWS), torch.arange(ROWS))
    assert train_step(model, optimizer, [warm], env.device, tokens=2 * ROWS * 8, max_grad_norm=1.0).loss > 0
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    values = train_step(model, optimizer, [mb], env.device, tokens=2 * ROWS * BIG_SEQ, max_grad_norm=1.0,
                        chunk_tokens=chunk_tokens)
    loss = values.loss
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    close_distributed()
    return {"rise_mib": (after - before) / 1024, "loss": loss}


def peak_rises(path: Path, chunk_tokens: int) -> tuple[float, float, float]:
    """The step's peak rise (MiB, the larger rank's) with the standard loss and with the chunked one, each in fresh
    processes, and their ratio.

    The ranks run with glibc's mmap threshold fixed at 64 KiB (MALLOC_MMAP_THRESHOLD_, read at process start;
    the spawned ranks inherit it): by default glibc raises the threshold to the largest block freed so far, after
    which the chunks' 16 MiB logits come from the heap, whose freed pages stay resident, and the high-water mark
    counts every chunk's logits though only one is alive at a time (172 MiB against 24 in the chunked backward
    of this model). With the threshold fixed, a freed block goes back to the system and the mark is the live peak.
    """
    rises = {}
    for name, chunk in (("standard", 0), ("chunked", chunk_tokens)):
        results = run_ranks(_step_peak, 2, timeout=600, path=path, chunk_tokens=chunk)
        rises[name] = max(r["rise_mib"] for r in results)
    return rises["standard"], rises["chunked"], rises["chunked"] / max(rises["standard"], 1e-9)


@pytest.mark.slow
def test_chunked_loss_lowers_the_peak_at_a_large_vocabulary(tmp_path, monkeypatch):
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    path = save_model(tmp_path / "big", vocab=BIG_VOCAB, max_position_embeddings=BIG_SEQ)
    standard, chunked, ratio = peak_rises(path, chunk_tokens=128)
    # 1,024 tokens x 32,000 x 4 bytes = 125 MiB per fp32 copy of the logits: the standard step holds several.
    assert standard > 200, standard
    assert ratio < 0.3, (standard, chunked)
    print(f"step peak rise: standard {standard:.0f} MiB, chunked {chunked:.0f} MiB, ratio {ratio:.2f}")


# ---------------------------------------------------------------- choosing it


def test_auto_reads_the_plans_decision_and_standard_until_there_is_one():
    assert loss_chunk_tokens("sft", "auto", {}) == 0
    assert loss_chunk_tokens("sft", "auto", {"loss": "standard"}) == 0
    assert loss_chunk_tokens("sft", "auto", {"loss": "chunked"}) > 0
    assert loss_chunk_tokens("sft", "chunked", {}) > 0
    assert loss_chunk_tokens("sft", "standard", {"loss": "chunked"}) == 0
    assert loss_chunk_tokens("dpo", "auto", {"loss": "chunked"}) == 0  # a preference loss is its own


def test_spec_refuses_chunked_for_the_methods_with_their_own_loss():
    with pytest.raises(ValueError, match="chunked loss is SFT's cross-entropy"):
        TrainSpec(max_steps=10, loss="chunked", method="reward")
    assert TrainSpec(max_steps=10, loss="auto", method="reward").loss == "auto"


def test_models_that_transform_their_logits_are_refused():
    from transformers import AutoModelForCausalLM, Gemma2Config

    from fsdpjob.jobs.model.chunkedloss import check_chunkable

    tiny = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1, head_dim=8)
    with torch.device("meta"):
        gemma2 = AutoModelForCausalLM.from_config(Gemma2Config(**tiny))
    with pytest.raises(ValueError, match="final_logit_softcapping"):
        check_chunkable(gemma2)
