"""Login-node checks of parquet, save_to_disk and mixture data: every problem is one line, `FILE:LINE: field:
what to do`, at the spec line to change (a missing or mistyped column, an empty source, a glob that matches
nothing, a split to choose, weights that do not add up) or at the file and row of a bad record."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from test_inputs import make_model

from fsdpjob.orchestrator.core.errors import InputError
from fsdpjob.orchestrator.core.inputs.checks import check_inputs
from fsdpjob.orchestrator.core.jobspec.spec import load_spec
from fsdpjob.orchestrator.core.jobspec.validation import SpecErrors

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
datasets = pytest.importorskip("datasets")

ROWS = [{"text": f"row {i}", "n": i} for i in range(5)]


def parquet(path: Path, rows: list[dict], schema=None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path)
    return path


def load(tmp_path: Path, data_yaml: str):
    """A spec with `data_yaml` as its data section (indented two spaces), next to a model folder."""
    make_model(tmp_path / "model")
    spec_file = tmp_path / "job.yaml"
    evaluation = "  eval_every: 5\n" if "eval_path" in data_yaml else ""
    train = f"train:\n  max_steps: 10\n{evaluation}"
    spec_file.write_text(f"name: formats\nmodel:\n  path: model\ndata:\n{data_yaml}{train}")
    return load_spec(spec_file)


def error(tmp_path: Path, data_yaml: str) -> InputError:
    spec, doc = load(tmp_path, data_yaml)
    with pytest.raises(InputError) as info:
        check_inputs(spec, doc)
    assert "\n" not in str(info.value)
    return info.value


def spec_errors(tmp_path: Path, data_yaml: str) -> list[InputError]:
    with pytest.raises(SpecErrors) as info:
        load(tmp_path, data_yaml)
    return info.value.errors


def test_every_format_and_a_mixture_pass(tmp_path):
    parquet(tmp_path / "one.parquet", ROWS)
    parquet(tmp_path / "parts" / "a.parquet", ROWS)
    parquet(tmp_path / "parts" / "b.parquet", ROWS)
    parquet(tmp_path / "single" / "only.parquet", ROWS)
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS),
                          "validation": datasets.Dataset.from_list(ROWS[:2])}).save_to_disk(str(tmp_path / "dict"))
    for data in ["  path: one.parquet\n", "  path: parts\n", "  path: single\n", "  path: 'single/*'\n",
                 "  path: parts/*.parquet\n", "  path: dict\n",
                 "  path: dict\n  eval_path: dict\n",  # eval_path's default split: validation
                 "  path: one.parquet\n  format: parquet\n",
                 "  sources:\n    - path: one.parquet\n      weight: 0.3\n    - path: dict\n      weight: 0.7\n"]:
        spec, doc = load(tmp_path, data)
        check_inputs(spec, doc)


@pytest.mark.parametrize("data_yaml, loc, line, words", [
    # A named field the table lacks: at the field's line; the default 'text': at the path's.
    ("  path: d.parquet\n  text_field: body\n", "data.text_field", 6, "d.parquet has no column 'body' (columns: "
     "text, n); set text_field"),
    ("  path: d.parquet\n  prompt_field: text\n  completion_field: n\n", "data.completion_field", 7,
     "column 'n' in {dir}/d.parquet is int64, not a string column"),
    ("  path: d.parquet\n  messages_field: text\n", "data.messages_field", 6,
     "is string, not a list of {role: string, content: string} structs"),
    ("  path: '*.json*'\n", "data.path", 5, "matches no files"),
    ("  path: nowhere\n", "data.path", 5, "data file {dir}/nowhere does not exist"),
])
def test_column_and_path_problems_point_at_the_spec_line(tmp_path, data_yaml, loc, line, words):
    parquet(tmp_path / "d.parquet", ROWS)
    err = error(tmp_path, data_yaml)
    assert (err.file, err.line, err.loc) == (str(tmp_path / "job.yaml"), line, loc)
    assert words.replace("{dir}", str(tmp_path)) in err.message, err.message


def test_format_parquet_on_a_jsonl_file_names_the_file_and_what_it_looks_like(tmp_path):
    (tmp_path / "d.jsonl").write_text('{"text": "a"}\n')
    err = error(tmp_path, "  path: d.jsonl\n  format: parquet\n")
    assert (err.loc, err.line) == ("data.path", 5), err
    assert f"{tmp_path}/d.jsonl is not a parquet file, though format is parquet: it looks like JSONL" in err.message
    assert "set format: jsonl" in err.message


def test_empty_table_and_empty_folder(tmp_path):
    parquet(tmp_path / "empty.parquet", [], schema=pa.schema([("text", pa.string())]))
    err = error(tmp_path, "  path: empty.parquet\n")
    assert (err.loc, err.line) == ("data.path", 5) and "has no examples (no rows)" in err.message
    (tmp_path / "nothing").mkdir()
    err = error(tmp_path, "  path: nothing\n")
    assert "holds no .parquet or .jsonl files" in err.message


def test_bad_row_names_its_file_and_row(tmp_path):
    bad = parquet(tmp_path / "parts" / "b.parquet", [{"text": "ok"}, {"text": "ok"}, {"text": None}])
    parquet(tmp_path / "parts" / "a.parquet", [{"text": "ok"}])
    err = error(tmp_path, "  path: parts\n")
    assert str(err) == f"{bad}:3: field 'text': expected a string, found null"
    rows = [{"m": [{"role": "user", "content": "a"}]}, {"m": [{"role": "user", "content": None}]}]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "chat"))
    err = error(tmp_path, "  path: chat\n  messages_field: m\n")
    assert str(err) == f"{tmp_path / 'chat'}:2: field 'm': message 0 has no 'content'"


def test_dataset_dict_split(tmp_path):
    datasets.DatasetDict({"a": datasets.Dataset.from_list(ROWS),
                          "b": datasets.Dataset.from_list(ROWS)}).save_to_disk(str(tmp_path / "dict"))
    err = error(tmp_path, "  path: dict\n")
    assert err.loc == "data.path" and "holds the splits a, b; set split" in err.message
    err = error(tmp_path, "  path: dict\n  split: train\n")
    assert "has no split 'train' (splits: a, b)" in err.message
    spec, doc = load(tmp_path, "  path: dict\n  split: a\n")
    check_inputs(spec, doc)
    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "one"))
    assert "drop split" in error(tmp_path, "  path: one\n  split: a\n").message
    # eval_path's default split is validation or test, never the training split
    err = error(tmp_path, "  path: dict\n  split: a\n  eval_path: dict\n")
    assert err.loc == "data.eval_path" and "holds the splits a, b; set split (eval_split for eval_path)" in err.message
    spec, doc = load(tmp_path, "  path: dict\n  split: a\n  eval_path: dict\n  eval_split: b\n")
    check_inputs(spec, doc)


def test_mixture_source_problems_point_at_the_source(tmp_path):
    parquet(tmp_path / "d.parquet", ROWS)
    datasets.Dataset.from_list([{"body": "x"}]).save_to_disk(str(tmp_path / "saved"))
    sources = "  sources:\n    - path: d.parquet\n      weight: 0.5\n    - path: saved\n      weight: 0.5\n"
    err = error(tmp_path, sources)
    assert (err.loc, err.line) == ("data.sources.1.path", 8) and "has no column 'text'" in err.message
    err = error(tmp_path, sources + "      text_field: nope\n")
    assert (err.loc, err.line) == ("data.sources.1.text_field", 10) and "no column 'nope'" in err.message
    spec, doc = load(tmp_path, sources + "      text_field: body\n")
    check_inputs(spec, doc)


@pytest.mark.parametrize("data_yaml, loc, line, words", [
    ("  sources:\n    - path: a.parquet\n      weight: 0.5\n    - path: b.parquet\n      weight: 0.8\n",
     "data.sources", 5, "the weights add up to 1.3 (0.5 + 0.8); each is the share of training sequences drawn from "
     "its source, so they must add up to 1: e.g. 0.3846, 0.6154"),
    ("  sources:\n    - path: a.parquet\n      weight: 0\n    - path: b.parquet\n      weight: 1\n",
     "data.sources.0.weight", 7, "greater than 0"),
    ("  sources:\n    - path: a.parquet\n", "data.sources.0.weight", 6, "required field is missing"),
    ("  sources: []\n", "data.sources", 5, "give at least one source"),
    ("  path: a.parquet\n  sources:\n    - path: b.parquet\n      weight: 1\n", "data.path", 5,
     "give path (one data set) or sources (a mixture), one of them"),
    ("  sources:\n    - path: a.parquet\n      weight: 0.5\n    - path: a.parquet\n      weight: 0.5\n",
     "data.sources", 5, "is listed twice"),
    ("  path: a.parquet\n  eval_split: test\n", "data.eval_split", 6, "set eval_path or drop eval_split"),
    ("  path: a.parquet\n  format: csv\n", "data.format", 6, "'auto', 'jsonl', 'parquet' or 'save_to_disk'"),
])
def test_spec_errors_of_the_data_section(tmp_path, data_yaml, loc, line, words):
    [err] = spec_errors(tmp_path, data_yaml)
    assert (err.file, err.line, err.loc) == (str(tmp_path / "job.yaml"), line, loc)
    assert words in err.message, err.message


def test_login_node_reads_tables_without_datasets_or_torch(tmp_path):
    """validate reads parquet footers and Arrow files with pyarrow alone; a JSONL spec does not even load that."""
    parquet(tmp_path / "d.parquet", ROWS)
    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "saved"))
    (tmp_path / "d.jsonl").write_text('{"text": "a"}\n')
    load(tmp_path, "  sources:\n    - path: d.parquet\n      weight: 0.5\n    - path: saved\n      weight: 0.5\n")
    code = ("import sys; from fsdpjob.orchestrator.core.jobspec.spec import load_spec; "
            "from fsdpjob.orchestrator.core.inputs.checks import check_inputs; check_inputs(*load_spec(sys.argv[1])); "
            "print(sorted({'torch', 'transformers', 'datasets', 'pyarrow'} & set(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "job.yaml")], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "['pyarrow']"
    load(tmp_path, "  path: d.jsonl\n")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "job.yaml")], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[]"


@pytest.mark.distributed
@pytest.mark.slow
def test_parquet_training_with_save_to_disk_eval_and_trackers_on_the_local_profile(tmp_path):
    """`fsdpjob submit --wait` on the local profile: a folder of parquet files to train on, the validation split of
    a save_to_disk DatasetDict to evaluate on, W&B offline and MLflow's local store; the loss falls."""
    import json
    from functools import partial

    import helpers

    from fsdpjob.jobs.quickstart import addition_examples, make_quickstart

    assets = make_quickstart(tmp_path / "assets")
    texts = [json.loads(line)["text"] for line in Path(assets["data_path"]).read_text().splitlines()]
    parquet(tmp_path / "train" / "part-0.parquet", [{"text": t} for t in texts[: len(texts) // 2]])
    parquet(tmp_path / "train" / "part-1.parquet", [{"text": t} for t in texts[len(texts) // 2:]])
    held_out = datasets.Dataset.from_list([{"text": t} for t in addition_examples(64, seed=9)])
    datasets.DatasetDict({"validation": held_out, "test": held_out}).save_to_disk(str(tmp_path / "heldout"))
    spec = tmp_path / "job.yaml"
    spec.write_text(f"""\
name: formats
profile: local
resources:
  tasks_per_node: 2
  time_limit: "20:00"
model:
  path: {assets['model_path']}
data:
  path: train
  eval_path: heldout
  seq_len: 64
train:
  max_steps: 30
  micro_batch_size: 8
  lr: 3.0e-3
  warmup_steps: 5
  log_every: 5
  eval_every: 15
  eval_batches: 1
fsdp:
  mixed_precision: fp32
logging:
  wandb:
    project: formats
  mlflow:
    experiment: formats-local
""")
    fsdpjob = partial(helpers.fsdpjob, env={**helpers.ONE_THREAD, "WANDB_SILENT": "true"}, timeout_s=600)
    assert fsdpjob("validate", str(spec)).returncode == 0
    run = fsdpjob("submit", str(spec), "--wait", "--json", env={**helpers.ONE_THREAD, "WANDB_API_KEY": ""})
    assert run.returncode == 0, run.stdout + run.stderr
    run_dir = Path(json.loads(run.stdout[: run.stdout.index("}") + 1])["run_dir"])
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [m["loss"] for m in metrics if "loss" in m]
    assert losses[-1] < 0.7 * losses[0], losses
    assert [m["step"] for m in metrics if "eval_loss" in m] == [15, 30]
    data_event = next(json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()
                      if json.loads(x)["event"] == "data")
    assert data_event["examples"] == len(texts) and data_event["eval_sequences"] > 0
    trackers = json.loads((run_dir / "trackers.json").read_text())
    [offline] = (run_dir / "wandb").glob(f"offline-run-*-{trackers['wandb']['id']}")
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir / 'mlflow.db'}")
    run_info = client.get_run(trackers["mlflow"]["run_id"]).info
    assert run_info.status == "FINISHED" and run_info.run_name == run_dir.name
    assert [m.step for m in client.get_metric_history(run_info.run_id, "eval/loss")] == [15, 30]


def test_validate_warns_when_many_examples_are_longer_than_seq_len(tmp_path):
    from fsdpjob.jobs.quickstart import build_tokenizer
    from fsdpjob.orchestrator.core.inputs.dataformats import long_example_warnings

    rows = [{"text": "short one"}] * 18 + [{"text": " ".join(["word"] * 200)}] * 2  # 10 % long
    parquet(tmp_path / "d.parquet", rows)
    spec, _ = load(tmp_path, "  path: d.parquet\n  seq_len: 64\n  long_examples: split\n")
    build_tokenizer(tmp_path / "model", ["short one", "word word"], vocab_size=300)
    warnings = long_example_warnings(spec.data, tmp_path / "model")
    assert len(warnings) == 1 and "2 of the first 20 examples" in warnings[0] and "split into seq_len" in warnings[0]
    few, _ = load(tmp_path / "few", "  path: ../d.parquet\n  seq_len: 512\n")
    assert long_example_warnings(few.data, tmp_path / "model") == []  # none longer: no warning
    done = subprocess.run([str(Path(sys.executable).with_name("fsdpjob")), "validate", str(tmp_path / "job.yaml")],
                          capture_output=True, text=True)
    assert done.returncode == 0 and "are longer than data.seq_len 64" in done.stderr, done.stderr


def test_validate_refuses_a_drop_that_leaves_no_example(tmp_path):
    """long_examples: drop over data whose every example is longer than seq_len: the workers would train on
    nothing; a warning was all validate said."""
    from fsdpjob.jobs.quickstart import build_tokenizer

    parquet(tmp_path / "d.parquet", [{"text": " ".join(["word"] * 200)}] * 3)
    load(tmp_path, "  path: d.parquet\n  seq_len: 64\n  long_examples: drop\n")
    build_tokenizer(tmp_path / "model", ["short one", "word word"], vocab_size=300)
    spec = tmp_path / "job.yaml"
    done = subprocess.run([str(Path(sys.executable).with_name("fsdpjob")), "validate", str(spec)],
                          capture_output=True, text=True)
    assert done.returncode == 2 and len(done.stderr.splitlines()) == 1, done.stderr
    assert done.stderr.startswith(f"{spec}:7: data.long_examples: all 3 examples read from {tmp_path / 'd.parquet'} "
                                  "are longer than data.seq_len 64, and drop leaves none;"), done.stderr
    spec.write_text(spec.read_text().replace("long_examples: drop", "long_examples: split"))
    done = subprocess.run([str(Path(sys.executable).with_name("fsdpjob")), "validate", str(spec)],
                          capture_output=True, text=True)
    assert done.returncode == 0 and "(100%)" in done.stderr, done.stderr
