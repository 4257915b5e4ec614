"""KTO end to end (jobs.train.run on 2 real gloo ranks): the first step's loss is the analytic value at policy ==
reference, the loss falls, a stop resumes bitwise, a live reference gives the cached losses. The data: 3-digit
additions, the right sum labelled desirable and zeros undesirable, balanced."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
from distributed import committed_model_state, run_ranks, write_run
from distributed import train_worker as _worker

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

STEPS, STOP_AT = 12, 5


def answer(rng: random.Random, good: bool) -> dict:
    """A desirable answer (the right sum) or an undesirable one (as many zeros: a pattern the tiny model learns
    to avoid in a few steps) to a new 3-digit addition."""
    a, b = rng.randrange(100, 1000), rng.randrange(100, 1000)
    return {"prompt": f"{a}+{b}=", "completion": str(a + b) if good else "0" * len(str(a + b)), "label": good}


def write_answers(path: Path, n: int, seed: int = 0) -> Path:
    rng = random.Random(seed)
    path.write_text("".join(json.dumps(answer(rng, i % 2 == 0)) + "\n" for i in range(n)))  # balanced
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    from fsdpjob.jobs.quickstart import make_quickstart

    root = tmp_path_factory.mktemp("kto")
    model = make_quickstart(root / "assets")["model_path"]
    data = str(write_answers(root / "answers.jsonl", 32))

    def make_run(name: str, **options) -> Path:
        return write_run(root, name, {
            "model": {"path": model},
            "data": {"path": data, "seq_len": 16},
            # Global batch 4 answers = 2 x 1 x 2 ranks.
            "train": {"max_steps": STEPS, "micro_batch_size": 2, "grad_accum_steps": 1, "lr": 2e-3,
                      "log_every": 1, "method": "kto", "lr_schedule": "constant"},
            "fsdp": {"mixed_precision": "fp32"},
            "checkpoint": {"interval_steps": 0, "interval_minutes": 0},
            **({"kto": options} if options else {}),
        })

    made = {"full": make_run("full"), "stopped": make_run("stopped"), "live": make_run("live", reference="live")}
    assert run_ranks(_worker, 2, run_dir=str(made["full"]), env={}) == [0, 0]
    assert run_ranks(_worker, 2, run_dir=str(made["stopped"]), env={"FSDPJOB_STOP_AT_STEP": str(STOP_AT)}) == [0, 0]
    assert run_ranks(_worker, 2, run_dir=str(made["stopped"]), env={}) == [0, 0]
    assert run_ranks(_worker, 2, run_dir=str(made["live"]), env={}) == [0, 0]
    return made


def metrics(run_dir: Path) -> dict[int, dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {m["step"]: m for m in map(json.loads, lines) if "loss" in m}


def events(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]


def test_kto_starts_at_half_the_weight_and_its_loss_falls(runs):
    m = metrics(runs["full"])
    assert set(m) == set(range(1, STEPS + 1))
    # At the first step the policy is the reference: every log-ratio and the KL are 0, so each answer's loss is
    # its weight * (1 - sigmoid(0)) = 1/2 with both weights 1.
    assert m[1]["loss"] == pytest.approx(0.5, abs=1e-6), m[1]
    for key in ("kl", "rewards/chosen", "rewards/rejected"):
        assert m[1][key] == pytest.approx(0, abs=1e-6), (key, m[1])
    first, last = sum(m[s]["loss"] for s in (1, 2, 3)) / 3, sum(m[s]["loss"] for s in range(STEPS - 2, STEPS + 1)) / 3
    assert last < first - 0.02, (first, last)
    assert all(math.isfinite(m[s]["kl"]) and m[s]["kl"] >= 0 for s in m)  # TRL's clamped batch estimate
    # TRL's means over each label's answers: logged where the global batch has answers of that label.
    for key in ("rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected"):
        assert all(math.isfinite(m[s][key]) for s in m if key in m[s]), key
        assert sum(key in m[s] for s in m) >= STEPS // 2, key
    late = [m[s]["rewards/chosen"] - m[s]["rewards/rejected"] for s in range(STEPS - 3, STEPS + 1)
            if "rewards/chosen" in m[s] and "rewards/rejected" in m[s]]
    assert late and sum(late) / len(late) > 0, m
    passes = [e for e in events(runs["full"]) if e["event"] == "reference"]
    assert [p["phase"] for p in passes] == ["start", "done"] and passes[-1]["rows"] == 32, passes


def test_a_kto_stop_resumes_bitwise(runs):
    full, stopped = metrics(runs["full"]), metrics(runs["stopped"])
    assert [e["step"] for e in events(runs["stopped"]) if e["event"] in ("stop", "resume")] == [STOP_AT, STOP_AT]
    for step in full:
        for key in ("loss", "kl", "rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected"):
            assert full[step].get(key) == stopped[step].get(key), (step, key)
    a, b = committed_model_state(runs["full"]), committed_model_state(runs["stopped"])
    assert all((a[k] == b[k]).all() for k in a)
    assert [p["phase"] for p in events(runs["stopped"]) if p["event"] == "reference"] == ["start", "done"]


def test_a_live_kto_reference_gives_the_cached_losses(runs):
    cached, live = metrics(runs["full"]), metrics(runs["live"])
    for step in cached:
        for key in ("loss", "kl"):
            assert live[step][key] == pytest.approx(cached[step][key], rel=1e-5, abs=1e-6), (step, key)
    assert not (runs["live"] / "reference").exists()


def test_the_cache_holds_each_answers_and_its_kl_rows_reference(runs):
    """The cache's two columns are the starting model's log-probabilities of each answer and of its KL row
    (its prompt with its partner's answer), computed here by the plain HF model outside FSDP."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fsdpjob.jobs.data.pairtable import pad_id_of
    from fsdpjob.jobs.data.preference import read_unpaired_table
    from fsdpjob.jobs.preference.batches import answer_rows
    from fsdpjob.jobs.preference.ktobatch import KtoTable
    from fsdpjob.jobs.preference.losses import answer_logps
    from fsdpjob.jobs.preference.reference import ReferenceCache
    from fsdpjob.orchestrator.core.jobspec.spec import JobSpec
    from fsdpjob.orchestrator.core.runfolder.runmeta import RunMeta

    spec = JobSpec.model_validate(RunMeta.read(runs["full"]).spec)
    tokenizer = AutoTokenizer.from_pretrained(spec.model.path)
    table = KtoTable.of(read_unpaired_table(spec.data, tokenizer), spec.train.seed, pad_id_of(tokenizer))
    [folder] = (runs["full"] / "reference").iterdir()
    cache = ReferenceCache(folder, len(table), 2)
    assert len(cache.load_written()) >= 1 and cache.complete
    model = AutoModelForCausalLM.from_pretrained(spec.model.path, torch_dtype=torch.float32).eval()
    ids, labels = answer_rows(table.micro_batch(torch.arange(len(table))))
    with torch.no_grad():
        logps, _ = answer_logps(model(input_ids=ids).logits, labels)
    expected = logps.view(2, -1).t()
    assert torch.allclose(cache.logps, expected, rtol=1e-5, atol=1e-4)
    assert not torch.allclose(cache.logps[:, 0], cache.logps[:, 1], atol=1e-2)  # the KL rows are other rows


def test_a_new_kto_run_continues_a_stopped_one_from_its_step_folder(runs, tmp_path):
    """`submit --resume-from <step folder of another run>` for kto: the answers' and the KL rows' reference come
    from the run that wrote the checkpoint (copied, no pass), and the steps after the stop are the straight run's."""
    from fsdpjob.orchestrator.core.runfolder.runmeta import RunMeta

    meta = json.loads((runs["full"] / "spec.json").read_text())
    continued = write_run(tmp_path, "continued", {k: v for k, v in meta["spec"].items() if k != "name"},
                          resume_from=str(runs["stopped"] / "checkpoints" / f"step-{STOP_AT:08d}"))
    assert RunMeta.read(continued).resume_from
    assert run_ranks(_worker, 2, run_dir=str(continued), env={}) == [0, 0]
    lines = events(continued)
    assert [e["step"] for e in lines if e["event"] == "resume"] == [STOP_AT]
    assert not [e for e in lines if e["event"] == "reference"]  # the stopped run's cache, copied
    full, after = metrics(runs["full"]), metrics(continued)
    assert sorted(after) == list(range(STOP_AT + 1, STEPS + 1)), sorted(after)
    for step in after:
        for key in ("loss", "kl", "rewards/chosen", "rewards/rejected"):
            assert after[step].get(key) == full[step].get(key), (step, key)
