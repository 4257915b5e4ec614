"""train.loss: chunked (jobs/model/chunkedloss.py) on 2 gloo ranks with FSDP2: the standard loss and gradients
within fp32 summation order (plain, tied embeddings, LoRA, boundary-aware packing in rows and flattened, bf16
compute), a lower peak at a large vocabulary, auto read from the plan's worker facts, and the refusals."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from distributed import run_ranks

from fsdpjob.jobs.step import loss_chunk_tokens
from fsdpjob.orchestrator.core.jobspec.modelspec import LoraSpec
from fsdpjob.orchestrator.core.jobspec.spec import TrainSpec

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import savers_memory
from savers_memory import measure

pytestmark = pytest.mark.distributed

VOCAB, SEQ, ROWS = 256, 24, 2  # ROWS per rank


def save_model(path: Path, *, vocab: int = VOCAB, **config) -> Path:
    return savers_memory.save_model(path, vocab=vocab, **config)


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
    from fsdpjob.jobs.step import token_loss_sum

    env = init_distributed(120)
    out = {}
    for name, (folder, options, packed, flatten, chunk) in CASES.items():
        model = savers_memory.load(folders[folder], env, **options)
        ids, labels, positions = batch(rank, packed=packed)
        standard, grads = _loss_and_grads(model, ids, labels, positions, chunk_tokens=0, flatten=flatten)
        chunked, chunked_grads = _loss_and_grads(model, ids, labels, positions, chunk_tokens=chunk, flatten=flatten)
        assert grads.keys() == chunked_grads.keys() and grads, name
        worst = max(float((chunked_grads[n] - g).abs().max() / g.abs().max().clamp_min(1e-30))
                    for n, g in grads.items())
        with torch.no_grad():  # evaluation's path (eval_loss): the chunks without checkpointing
            no_grad = token_loss_sum(model, ids, labels, positions, torch.device("cpu"), chunk_tokens=chunk,
                                     flatten=flatten).item()
        out[name] = {"loss": (standard, chunked), "no_grad": no_grad, "grad_rel": worst, "params": sorted(grads),
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
    assert result["no_grad"] == chunked  # the same chunks, with or without their recomputation
    assert result["grad_rel"] <= 1e-5, result["grad_rel"]


def test_chunked_loss_reaches_the_tied_weight_and_only_the_adapters_with_lora(equivalence):
    assert equivalence["tied"]["tied"] and not equivalence["plain"]["tied"]
    assert "lm_head.weight" not in equivalence["tied"]["params"]  # one parameter: the embedding's, both uses
    assert all(".lora_" in n for n in equivalence["lora"]["params"]), equivalence["lora"]["params"][:3]


def test_chunked_loss_with_bf16_compute_is_close(equivalence):
    standard, chunked = equivalence["bf16"]["loss"]
    assert abs(chunked - standard) <= 1e-3 * abs(standard) and equivalence["bf16"]["grad_rel"] <= 2e-2


# ---------------------------------------------------------------- the peak


@pytest.mark.slow
def test_chunked_loss_lowers_the_peak_at_a_large_vocabulary(tmp_path):
    """bench/savers_memory.py's measurement (how and why there): the rise of each fresh rank's high-water mark.
    This process first holds 1 GiB, as a pytest worker that ran bigger tests has: a rank's reading must not carry
    its parent's high-water mark (ru_maxrss does, across fork and exec; in CI it read a rise of 0)."""
    held = bytearray(1 << 30)
    held[:: 1 << 12] = b"x" * len(held[:: 1 << 12])  # touch every page: resident, not only reserved
    del held
    standard = measure(save_model(tmp_path / "big", vocab=32000, max_position_embeddings=512), vocab=32000, seq=512,
                       rows=ROWS, chunk_tokens=0)
    chunked = measure(tmp_path / "big", vocab=32000, seq=512, rows=ROWS, chunk_tokens=128)
    # 1,024 tokens x 32,000 x 4 bytes = 125 MiB per fp32 copy of the logits: the standard step holds several.
    assert standard["rise_mib"] > 200, standard
    assert chunked["rise_mib"] < 0.3 * standard["rise_mib"], (standard, chunked)
    assert abs(chunked["loss"] - standard["loss"]) <= 1e-6 * standard["loss"]


# ---------------------------------------------------------------- choosing it


def test_auto_reads_the_plans_decision_and_standard_until_there_is_one():
    llama = {"model_type": "llama"}
    assert loss_chunk_tokens("sft", "auto", {}, llama) == 0
    assert loss_chunk_tokens("sft", "auto", {"loss": "standard"}, llama) == 0
    assert loss_chunk_tokens("sft", "auto", {"loss": "chunked"}, llama) > 0
    assert loss_chunk_tokens("sft", "chunked", {}, llama) > 0
    assert loss_chunk_tokens("sft", "standard", {"loss": "chunked"}, llama) == 0
    assert loss_chunk_tokens("dpo", "auto", {"loss": "chunked"}, llama) == 0  # a preference loss is its own


def test_spec_refuses_chunked_for_the_methods_with_their_own_loss():
    with pytest.raises(ValueError, match="chunked loss is SFT's cross-entropy"):
        TrainSpec(max_steps=10, loss="chunked", method="reward")
    assert TrainSpec(max_steps=10, loss="auto", method="reward").loss == "auto"


def test_models_that_transform_their_logits_keep_the_standard_loss():
    """gemma2's soft cap (cohere's and granite's scales alike) is applied by the model's forward after lm_head: auto
    keeps the standard loss for it, chunked is refused at submit (the login node's config.json check) and on the
    worker, and a neutral value (granite's default 1.0) is no transform."""
    from fsdpjob.orchestrator.core.jobspec.families import logit_transform

    gemma2 = {"model_type": "gemma2", "final_logit_softcapping": 30.0}
    assert logit_transform(gemma2) == "final_logit_softcapping"
    assert logit_transform({"model_type": "granite", "logits_scaling": 1.0}) is None
    assert logit_transform({"model_type": "cohere", "logit_scale": 0.0625}) == "logit_scale"
    assert loss_chunk_tokens("sft", "auto", {"loss": "chunked"}, gemma2) == 0
    with pytest.raises(ValueError, match="final_logit_softcapping"):
        loss_chunk_tokens("sft", "chunked", {}, gemma2)


def test_submit_checks_refuse_chunked_for_a_model_that_transforms_its_logits(tmp_path):
    import json

    from helpers import tiny_model_folder

    from fsdpjob.orchestrator.core.errors import InputError
    from fsdpjob.orchestrator.core.inputs.checks import check_inputs
    from fsdpjob.orchestrator.core.jobspec.spec import JobSpec

    folder = tiny_model_folder(tmp_path / "m")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "gemma2", "final_logit_softcapping": 30.0,
                                                    "architectures": ["Gemma2ForCausalLM"]}))
    spec = JobSpec.model_validate({"name": "x", "model": {"path": str(folder)},
                                   "data": {"path": "d.jsonl", "seq_len": 128},
                                   "train": {"max_steps": 2, "loss": "chunked"}})
    with pytest.raises(InputError, match="final_logit_softcapping"):
        check_inputs(spec, config_only=True)
    check_inputs(JobSpec.model_validate({**spec.model_dump(), "train": {"max_steps": 2}}), config_only=True)
