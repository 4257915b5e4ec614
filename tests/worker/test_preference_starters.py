"""`fsdpjob init --method kto` and `--method reward` write starters that train: each, pointed at the quickstart's
tiny model and a few lines of its data shape, runs a few steps on 2 real gloo ranks (the local profile's way)."""

from __future__ import annotations

from pathlib import Path

import pytest
from distributed import run_ranks, write_run
from distributed import train_worker as _worker
from test_kto_train import write_answers
from test_preference_train import metrics, write_pairs

from fsdpjob.orchestrator.cli.firstjob import write_starter
from fsdpjob.orchestrator.core.jobspec.spec import load_spec

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

STEPS = 4
SHORT = [f"train.max_steps={STEPS}", "train.log_every=1", "data.seq_len=16", "train.lr=1e-3",
         "checkpoint.interval_minutes=0"]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    from fsdpjob.jobs.quickstart import make_quickstart

    return Path(make_quickstart(tmp_path_factory.mktemp("assets"))["model_path"])


@pytest.mark.parametrize("method", ["kto", "reward"])
def test_the_starter_trains(tmp_path, model, method):
    data = write_answers(tmp_path / "data.jsonl", 16) if method == "kto" else write_pairs(tmp_path / "data.jsonl", 16)
    written = write_starter(tmp_path / "job.yaml", "local", model, None, method)
    assert written.todo == []  # the model given, the data beside the spec
    spec, _ = load_spec(tmp_path / "job.yaml", SHORT)
    assert spec.train.method == method and spec.data.path == str(data) and spec.resources.tasks_per_node == 2
    run = write_run(tmp_path, "run", spec.model_dump(mode="json"))
    assert run_ranks(_worker, 2, run_dir=str(run), env={}) == [0, 0]
    m = metrics(run)
    assert sorted(m) == list(range(1, STEPS + 1)) and all(m[s]["loss"] == m[s]["loss"] for s in m), m  # not NaN
    assert ("kl" if method == "kto" else "accuracy") in m[STEPS], m[STEPS]
