"""W&B (offline) and MLflow (its local store) as the workers drive them: the scalars land in the W&B offline run
and the MLflow store, a stopped and resumed run stays one tracker run, only rank 0 logs, no secret reaches
the run folder, and a tracker that fails does not stop training."""

from __future__ import annotations

import json
import secrets
import struct
import sys
from pathlib import Path

import pytest
from distributed import run_ranks, train_worker
from specs import job_spec

wandb = pytest.importorskip("wandb")
mlflow = pytest.importorskip("mlflow")

from fsdpjob.jobs.report.trackers import TRACKERS_FILE, TrackerError, Trackers  # noqa: E402
from fsdpjob.orchestrator.core.jobspec.spec import JobSpec  # noqa: E402
from fsdpjob.orchestrator.core.runfolder import runlog  # noqa: E402

KEY = f"wandb-{secrets.token_hex(16)}"  # unique: finding it anywhere is a leak
TOKEN = f"mlflow-{secrets.token_hex(16)}"


def make_spec(model: str = "/m", data: dict | None = None, *, wandb_mode: str = "offline", train: dict | None = None,
              **logging) -> JobSpec:
    return job_spec({
        "name": "trk", "env": {"WANDB_API_KEY": KEY, "MLFLOW_TRACKING_TOKEN": TOKEN},
        "model": {"path": model}, "data": data or {"path": "/d.jsonl", "seq_len": 32},
        "train": {"max_steps": 6, "micro_batch_size": 1, "grad_accum_steps": 2, "lr": 3e-3, "log_every": 1,
                  **(train or {})},
        "fsdp": {"mixed_precision": "fp32"}, "checkpoint": {"interval_steps": 0, "interval_minutes": 0},
        "logging": logging or {"wandb": {"project": "fsdpjob-test", "mode": wandb_mode}, "mlflow": {}},
    })


def write_tracked_run(root: Path, spec: JobSpec) -> Path:
    """A run folder as submit writes it, the spec redacted (its secrets reach the workers through their env)."""
    run_dir = root / spec.name
    run_dir.mkdir()
    (run_dir / "spec.json").write_text(json.dumps({"spec": spec.redacted().model_dump(mode="json"), "resume_from": None,
                                                   "plan": {"defer_grad_sync": True}}))
    return run_dir


TRACKED_ENV = {"WANDB_API_KEY": KEY, "MLFLOW_TRACKING_TOKEN": TOKEN, "WANDB_SILENT": "true"}


# ---------------------------------------------------------------- reading what the trackers wrote


def wandb_records(path: Path):
    """The records of a .wandb file: W&B's LevelDB-style log (7-byte header, 32 KiB blocks of chunks) of protobufs."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, pos, chunk = path.read_bytes(), 7, b""
    assert data[:4] == b":W&B", data[:7]
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a chunk header is padding
            pos += 32768 - pos % 32768
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if not length and not kind:
            break
        chunk, pos = chunk + data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (1, 4):  # a full record, or the last chunk of one
            record = pb.Record()
            record.ParseFromString(chunk)
            chunk = b""
            yield record


def wandb_runs(run_dir: Path) -> dict[str, list[dict]]:
    """W&B run id -> the history rows of its offline runs (one folder per start), in start order."""
    out: dict[str, list[dict]] = {}
    for folder in sorted((run_dir / "wandb").glob("offline-run-*")):
        [log] = folder.glob("run-*.wandb")
        records = list(wandb_records(log))
        [run_id] = {r.run.run_id for r in records if r.WhichOneof("record_type") == "run"}
        out.setdefault(run_id, []).extend(
            {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
            for r in records if r.WhichOneof("record_type") == "history")
    return out


def mlflow_run(run_dir: Path):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir / 'mlflow.db'}")
    [experiment] = [e for e in client.search_experiments() if e.name == "trk"]
    [run] = client.search_runs([experiment.experiment_id])
    return client, run


def assert_no_secret(run_dir: Path) -> None:
    for path in run_dir.rglob("*"):
        if path.is_file():
            data = path.read_bytes()
            assert KEY.encode() not in data and TOKEN.encode() not in data, path


# ---------------------------------------------------------------- the trackers themselves


@pytest.fixture()
def worker_env(monkeypatch):
    """The workers' environment: the spec's secret values are in it (W&B and MLflow read them there)."""
    monkeypatch.setenv("WANDB_API_KEY", KEY)
    monkeypatch.setenv("MLFLOW_TRACKING_TOKEN", TOKEN)
    monkeypatch.setenv("WANDB_SILENT", "true")


def start(spec: JobSpec, run_dir: Path, steps: range, end: str) -> None:
    trackers = Trackers(spec, run_dir)
    for step in steps:
        trackers.log(step, {"train/loss": 1 / step, "train/lr": 0.1})
    trackers.log(steps[-1], {"eval/loss": 0.5})
    trackers.on_event(end)
    trackers.close()


def test_a_restarted_run_logs_on_into_the_same_tracker_runs(tmp_path, worker_env):
    spec = make_spec()
    start(spec, tmp_path, range(1, 4), runlog.STOP)
    ids = json.loads((tmp_path / TRACKERS_FILE).read_text())
    client, run = mlflow_run(tmp_path)
    assert run.info.status == "KILLED" and run.info.run_id == ids["mlflow"]["run_id"]
    start(spec, tmp_path, range(3, 7), runlog.DONE)  # resumed from step 2's checkpoint: step 3 is logged again
    assert json.loads((tmp_path / TRACKERS_FILE).read_text()) == ids

    runs = wandb_runs(tmp_path)
    assert list(runs) == [ids["wandb"]["id"]] and len(list((tmp_path / "wandb").glob("offline-run-*"))) == 2
    losses = [(row["step"], row["train/loss"]) for row in runs[ids["wandb"]["id"]] if "train/loss" in row]
    assert losses == [(s, 1 / s) for s in (1, 2, 3, 3, 4, 5, 6)]
    assert [row["step"] for row in runs[ids["wandb"]["id"]] if "eval/loss" in row] == [3, 6]

    client, run = mlflow_run(tmp_path)
    assert run.info.run_id == ids["mlflow"]["run_id"] and run.info.status == "FINISHED"
    history = client.get_metric_history(run.info.run_id, "train/loss")
    assert sorted({m.step for m in history}) == [1, 2, 3, 4, 5, 6]
    assert run.data.params["train.max_steps"] == "6" and run.data.params["env.WANDB_API_KEY"] == "<secret>"
    assert run.data.tags["fsdpjob.run_id"] == tmp_path.name
    assert not (Path.cwd() / "mlruns").exists() and not (Path.cwd() / "wandb").exists()
    assert_no_secret(tmp_path)


def test_wandb_is_offline_without_a_key_and_mlflow_finds_its_run_by_tag(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    spec = make_spec(wandb_mode="auto")
    start(spec, tmp_path, range(1, 3), runlog.STOP)
    (tmp_path / TRACKERS_FILE).unlink()  # lost: W&B starts a new run, MLflow finds its run by the fsdpjob run id
    start(spec, tmp_path, range(3, 5), runlog.DONE)
    assert len(wandb_runs(tmp_path)) == 2
    client, run = mlflow_run(tmp_path)
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "train/loss")) == [1, 2, 3, 4]


def test_a_tracker_that_fails_is_dropped_and_training_goes_on(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    spec = make_spec(mlflow={"tracking_uri": "http://127.0.0.1:9"})  # nothing listens on the discard port
    trackers = Trackers(spec, tmp_path)
    trackers.log(1, {"train/loss": 1.0})
    trackers.close()
    assert "mlflow is off for this start: it failed to open" in caplog.text


def test_a_missing_tracker_package_stops_the_start(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb now raises ImportError
    with pytest.raises(TrackerError, match=r"logging.wandb needs the wandb package on the workers: pip install "
                                           r"'fsdpjob\[wandb\]'"):
        Trackers(make_spec(wandb={"project": "p"}), tmp_path)


# ---------------------------------------------------------------- in the worker, stopped and resumed


@pytest.mark.distributed
@pytest.mark.slow
def test_the_worker_stopped_and_resumed_keeps_one_tracker_run(tmp_path_factory, worker_env):
    """Two gloo ranks train a parquet + save_to_disk mixture, stop at step 3 (the requeue path) and resume: one W&B
    run and one MLflow run hold steps 1 to 6, written by rank 0 alone."""
    pq = pytest.importorskip("pyarrow.parquet")
    datasets = pytest.importorskip("datasets")
    import pyarrow as pa

    from fsdpjob.jobs.quickstart import addition_examples, make_quickstart

    assets = make_quickstart(tmp_path_factory.mktemp("assets"))
    texts = addition_examples(200, seed=1)
    folder = tmp_path_factory.mktemp("data")
    pq.write_table(pa.Table.from_pylist([{"text": t} for t in texts[:150]]), folder / "a.parquet")
    datasets.Dataset.from_list([{"body": t} for t in texts[150:]]).save_to_disk(str(folder / "saved"))
    data = {"sources": [{"path": str(folder / "a.parquet"), "weight": 0.6},
                        {"path": str(folder / "saved"), "weight": 0.4, "text_field": "body"}], "seq_len": 32}
    spec = make_spec(assets["model_path"], data)
    run_dir = write_tracked_run(tmp_path_factory.mktemp("runs"), spec)
    env = TRACKED_ENV
    assert run_ranks(train_worker, 2, run_dir=str(run_dir), env={**env, "FSDPJOB_STOP_AT_STEP": "3"}) == [0, 0]
    assert run_ranks(train_worker, 2, run_dir=str(run_dir), env=env) == [0, 0]

    events = [json.loads(x)["event"] for x in (run_dir / "events.jsonl").read_text().splitlines()]
    assert "stop" in events and events[-1] == "done"
    runs = wandb_runs(run_dir)
    assert len(runs) == 1 and len(list((run_dir / "wandb").glob("offline-run-*"))) == 2  # rank 0's two starts
    [rows] = runs.values()
    assert [row["step"] for row in rows if "train/loss" in row] == [1, 2, 3, 4, 5, 6]
    client, run = mlflow_run(run_dir)
    assert run.info.status == "FINISHED"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")] == [1, 2, 3, 4, 5, 6]
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["loss"] for m in metrics] == [r["train/loss"] for r in rows if "train/loss" in r]
    assert_no_secret(run_dir)


@pytest.mark.distributed
@pytest.mark.slow
def test_dpo_metrics_reach_both_trackers_under_trls_names(tmp_path, worker_env):
    """A DPO run's own metrics (rewards/margins, rewards/accuracies, logps/chosen ...) and its evaluation's
    (eval_rewards/accuracies ...) reach W&B and MLflow as train/<name> and eval/<name>, with metrics.jsonl's
    values."""
    from test_preference_train import write_pairs

    from fsdpjob.jobs.quickstart import make_quickstart

    assets = make_quickstart(tmp_path / "assets")
    pairs = write_pairs(tmp_path / "pairs.jsonl", 24)
    spec = make_spec(assets["model_path"], {"path": str(pairs), "seq_len": 16, "eval_fraction": 0.25},
                     train={"method": "dpo", "eval_every": 3})
    run_dir = write_tracked_run(tmp_path, spec)
    assert run_ranks(train_worker, 2, run_dir=str(run_dir), env=TRACKED_ENV) == [0, 0]

    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    trained = [m for m in lines if "loss" in m]
    evaluated = [m for m in lines if "eval_loss" in m]
    assert len(trained) == 6 and [m["step"] for m in evaluated] == [3, 6]
    names = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
             "logps/rejected")
    [rows] = wandb_runs(run_dir).values()
    for name in names:
        assert [r[f"train/{name}"] for r in rows if f"train/{name}" in r] == [m[name] for m in trained], name
    assert [r["eval/rewards/accuracies"] for r in rows if "eval/rewards/accuracies" in r] == \
        [m["eval_rewards/accuracies"] for m in evaluated]
    client, run = mlflow_run(run_dir)
    for key, values in ((f"train/{n}", [m[n] for m in trained]) for n in names):
        history = sorted(client.get_metric_history(run.info.run_id, key), key=lambda m: m.step)
        assert [m.value for m in history] == pytest.approx(values), key
    history = client.get_metric_history(run.info.run_id, "eval/rewards/margins")
    assert sorted(m.step for m in history) == [3, 6]
    assert run.data.params["train.method"] == "dpo"
    assert_no_secret(run_dir)
