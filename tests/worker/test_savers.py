"""The memory savers of the model section on 2 gloo ranks (issue 41): selective activation checkpointing (op-level
and every N-th block) and fsdp.separate_root give the plain path's loss and gradients bitwise (recomputation
replays the same ops on the same inputs; a unit boundary moves where a gradient is reduce-scattered, and a sum
of two ranks' values is the same in either order), a run stopped and resumed with them equals one that trains
straight, and each lowers the process's peak memory where the plan says it does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from distributed import run_ranks
from test_model import _batch, _load, _train, save_tiny

from fsdpjob.jobs.dist import close_distributed, init_distributed
from fsdpjob.jobs.model.checkpointing import FULL, NONE, Checkpointing

pytestmark = pytest.mark.distributed

OP, EVERY_2 = Checkpointing("selective", "op"), Checkpointing("selective", 2)


def _loss_and_grads(model, ids, **forward) -> tuple[float, dict[str, torch.Tensor]]:
    out = model(input_ids=ids, use_cache=False, **forward)  # as the worker runs it (jobs/step.py)
    loss = out.loss if out.loss is not None else out.logits.float().square().mean()
    loss.backward()
    grads = {n.replace("._checkpoint_wrapped_module", ""): p.grad.full_tensor()
             for n, p in model.named_parameters() if p.grad is not None}
    return loss.item(), grads


def _units(model) -> set[tuple[str, ...]]:
    """The FSDP units other than the blocks and the root, each as the names of the modules it shards together."""
    from torch.distributed.fsdp import FSDPModule

    groups: dict[int, list[str]] = {}
    for n, m in model.named_modules():
        if isinstance(m, FSDPModule) and n and ".layers." not in f".{n}.":
            groups.setdefault(id(m._get_fsdp_state()), []).append(n)
    return {tuple(names) for names in groups.values()}


def _variants(rank: int, world_size: int, cases: dict[str, tuple[str, dict]]) -> dict[str, dict]:
    """Per case: the loss, the names of the gradients that differ from its case's plain run, and the FSDP units
    other than the blocks and the root."""
    env = init_distributed(60)
    ids = _batch(0)[rank * 2: rank * 2 + 2]
    out, plain = {}, {}
    for name, (path, options) in cases.items():
        torch.manual_seed(0)  # LoRA's and the score head's first values
        model = _load(path, env, **options)
        forward = {} if options.get("head") == "score" else {"labels": ids}
        loss, grads = _loss_and_grads(model, ids, **forward)
        base = plain.setdefault(path + str(options.get("head")) + str(options.get("lora")), (loss, grads))
        differ = sorted(n for n in base[1].keys() | grads.keys()
                        if n not in grads or n not in base[1] or not torch.equal(grads[n], base[1][n]))
        out[name] = {"loss": loss, "plain_loss": base[0], "differ": differ, "units": _units(model),
                     "wrapped": sum(".layers." in n and n.endswith("_checkpoint_wrapped_module")
                                    for n, _ in model.named_modules())}
    close_distributed()
    return out


@pytest.fixture(scope="module")
def variants(tmp_path_factory) -> dict:
    from fsdpjob.orchestrator.core.jobspec.modelspec import LoraSpec

    tmp = tmp_path_factory.mktemp("savers")
    untied = str(save_tiny(tmp / "untied", num_hidden_layers=4))
    tied = str(save_tiny(tmp / "tied", tie_word_embeddings=True))
    lora = LoraSpec(modules_to_save=["embed_tokens"])
    score = {"head": "score", "pad_token_id": 0}
    cases = {
        "plain": (untied, {}),
        "full": (untied, {"activation_checkpointing": FULL}),
        "op": (untied, {"activation_checkpointing": OP}),
        "every_2": (untied, {"activation_checkpointing": EVERY_2}),
        "separate_root": (untied, {"separate_root": True}),
        "separate_root_op_no_reshard": (untied, {"separate_root": True, "activation_checkpointing": OP,
                                                 "reshard_after_forward": False}),
        "tied_plain": (tied, {}),
        "tied_separate_root": (tied, {"separate_root": True}),
        "lora_plain": (untied, {"lora": lora}),
        "lora_separate_root_op": (untied, {"lora": lora, "separate_root": True, "activation_checkpointing": OP}),
        "score_plain": (untied, score),
        "score_separate_root_op": (untied, {**score, "separate_root": True, "activation_checkpointing": OP}),
    }
    return run_ranks(_variants, 2, cases=cases)  # by rank (each rank's loss is its own rows')


@pytest.mark.parametrize("case", ["full", "op", "every_2", "separate_root", "separate_root_op_no_reshard",
                                  "tied_separate_root", "lora_separate_root_op", "score_separate_root_op"])
def test_each_saver_gives_bitwise_the_plain_loss_and_gradients(variants, case):
    for result in (rank[case] for rank in variants):
        assert result["loss"] == result["plain_loss"] and result["differ"] == [], result


def test_which_blocks_are_wrapped(variants):
    assert [variants[0][c]["wrapped"] for c in ("plain", "full", "op", "every_2")] == [0, 4, 4, 2]


def test_separate_root_shards_the_embedding_and_the_norm_with_the_head_apart(variants):
    variants = variants[0]
    assert variants["plain"]["units"] == set()
    assert variants["separate_root"]["units"] == {("model.embed_tokens",), ("model.norm", "lm_head")}
    assert variants["tied_separate_root"]["units"] == set()  # one weight in two modules: stays with the root
    assert variants["lora_separate_root_op"]["units"] == {("model.embed_tokens",), ("model.norm", "lm_head")}
    assert variants["score_separate_root_op"]["units"] == {("model.embed_tokens",), ("model.norm", "score")}


def test_a_bool_is_refused_where_the_mode_is_expected():
    from torch import nn

    from fsdpjob.jobs.model.checkpointing import wrap_blocks

    with pytest.raises(TypeError, match="must be a Checkpointing"):
        wrap_blocks(nn.ModuleList([nn.Linear(2, 2)]), True)
    with pytest.raises(ValueError, match="selective_ac"):
        Checkpointing("selective", 0)


def test_auto_reads_the_planners_fact_and_is_off_without_it():
    from fsdpjob.jobs.parts import resolve_separate_root

    assert resolve_separate_root("auto", {}) is False
    assert resolve_separate_root("auto", {"separate_root": True}) is True
    assert resolve_separate_root(False, {"separate_root": True}) is False
    assert resolve_separate_root(True, {}) is True


def _compiled_op(rank: int, world_size: int, path: str) -> tuple:
    import torch._dynamo

    env = init_distributed(300)
    rows = slice(rank * 2, rank * 2 + 2)
    eager = _train(_load(path, env, activation_checkpointing=OP), 3, rows)
    torch._dynamo.utils.counters.clear()
    compiled = _train(_load(path, env, activation_checkpointing=OP, compile_layers="aot_eager"), 3, rows)
    counters = torch._dynamo.utils.counters
    close_distributed()
    return eager, compiled, counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())


@pytest.mark.slow
def test_selective_op_blocks_compile_in_one_graph_and_train_like_eager_ones(tmp_path):
    """model.compile with selective op AC: dynamo takes the policy's context_fn (one graph for both blocks, no
    break), and three AdamW steps give eager's losses within fp32 tolerance (bitwise here, aot_eager on CPU)."""
    for eager, compiled, graphs, breaks in run_ranks(_compiled_op, 2, timeout=900, path=str(save_tiny(tmp_path / "m"))):
        assert graphs == 1 and breaks == 0
        assert all(abs(a - b) <= 1e-5 * abs(a) for a, b in zip(eager, compiled, strict=True)), (eager, compiled)


# ---------------------------------------------------------------- peak memory


def _peak(rank: int, world_size: int, path: str, options: dict, rows: int, seq: int, vocab: int) -> int:
    """This fresh rank process's peak RSS over one forward and backward, above its RSS before it (bytes)."""
    import gc
    import re

    def status_kib(field: str) -> int:
        return int(re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M).group(1))

    torch.set_num_threads(1)
    env = init_distributed(300)
    model = _load(path, env, **options)
    ids = torch.randint(0, vocab, (rows, seq), generator=torch.Generator().manual_seed(rank))
    model(input_ids=ids[:, :8], labels=ids[:, :8], use_cache=False).loss.backward()  # lazy init, one-time buffers
    model.zero_grad(set_to_none=True)
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS (Linux)
    base = status_kib("VmRSS")
    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    peak = status_kib("VmHWM") - base
    close_distributed()
    return peak * 1024


def _peaks(path: Path, variants: dict[str, dict], **shape) -> dict[str, int]:
    """Each variant in its own pair of fresh processes: the larger of the two ranks' peaks."""
    return {name: max(run_ranks(_peak, 2, timeout=600, path=str(path), options=options, **shape))
            for name, options in variants.items()}


@pytest.mark.slow
def test_selective_op_peaks_between_full_and_none(tmp_path):
    """Activations dominate (4 blocks, 2 x 1024 tokens a rank, a vocabulary of 256)."""
    path = save_tiny(tmp_path / "m", hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
                     num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=1024)
    peaks = _peaks(path, {"none": {"activation_checkpointing": NONE}, "op": {"activation_checkpointing": OP},
                          "full": {"activation_checkpointing": FULL}}, rows=2, seq=1024, vocab=256)
    print({k: f"{v / 2**20:.0f} MiB" for k, v in peaks.items()})
    assert peaks["full"] < peaks["op"] < peaks["none"], peaks


@pytest.mark.slow
def test_separate_root_lowers_the_peak_where_the_embedding_and_head_dominate(tmp_path):
    """A 64K vocabulary by 512 (two 128 MiB fp32 matrices), one small block, 2 x 32 tokens a rank."""
    path = save_tiny(tmp_path / "m", vocab_size=65536, hidden_size=512, intermediate_size=512, num_hidden_layers=1,
                     num_attention_heads=4, num_key_value_heads=4)
    peaks = _peaks(path, {"root": {}, "separate_root": {"separate_root": True}}, rows=2, seq=32, vocab=65536)
    print({k: f"{v / 2**20:.0f} MiB" for k, v in peaks.items()})
    assert peaks["separate_root"] < peaks["root"], peaks


# ---------------------------------------------------------------- the worker, stopped and resumed

STEPS, STOP_AT = 6, 3


def _run(root: Path, name: str, assets: dict, model: dict, fsdp: dict, facts: dict | None = None) -> Path:
    from distributed import write_run

    return write_run(root, name, {
        "model": {"path": assets["model_path"], **model},
        "data": {"path": assets["data_path"], "seq_len": 32},
        "train": {"max_steps": STEPS, "micro_batch_size": 1, "grad_accum_steps": 2, "lr": 3e-3, "log_every": 1},
        "fsdp": {"mixed_precision": "fp32", **fsdp},
        "checkpoint": {"interval_steps": 0, "interval_minutes": 0},
    }, facts=facts)


@pytest.mark.slow
def test_the_worker_with_the_savers_trains_the_plain_steps_and_resumes_bitwise(tmp_path):
    """jobs.train.run: selective op AC with separate_root true, and every-2nd-block AC with separate_root auto
    (the plan's fact says true), each train the plain run's losses bitwise; the first, stopped at step 3 and
    resumed, equals its straight run bitwise (losses and the committed weights)."""
    from distributed import committed_model_state, logged_losses
    from distributed import train_worker as worker

    from fsdpjob.jobs.quickstart import make_quickstart

    assets = make_quickstart(tmp_path / "assets")
    op = ({"activation_checkpointing": "selective", "selective_ac": "op"}, {"separate_root": True})
    runs = {"plain": _run(tmp_path, "plain", assets, {}, {}),
            "op": _run(tmp_path, "op", assets, *op),
            "op_stopped": _run(tmp_path, "op_stopped", assets, *op),
            "every_2_auto": _run(tmp_path, "every_2_auto", assets,
                                 {"activation_checkpointing": "selective", "selective_ac": 2},
                                 {"separate_root": "auto"}, facts={"separate_root": True})}
    for name, run_dir in runs.items():
        env = {"FSDPJOB_STOP_AT_STEP": str(STOP_AT)} if name == "op_stopped" else {}
        assert run_ranks(worker, 2, run_dir=str(run_dir), env=env) == [0, 0], name
    assert run_ranks(worker, 2, run_dir=str(runs["op_stopped"]), env={}) == [0, 0]
    events = [json.loads(x) for x in (runs["op_stopped"] / "events.jsonl").read_text().splitlines()]
    assert [e["step"] for e in events if e["event"] == "resume"] == [STOP_AT]
    losses = {name: logged_losses(run_dir) for name, run_dir in runs.items()}
    assert set(losses["plain"]) == set(range(1, STEPS + 1))
    assert losses["op"] == losses["plain"] == losses["every_2_auto"], losses
    assert losses["op_stopped"] == losses["op"], losses
    straight, resumed = committed_model_state(runs["op"]), committed_model_state(runs["op_stopped"])
    assert straight.keys() == resumed.keys() and all(torch.equal(straight[k], resumed[k]) for k in straight)
