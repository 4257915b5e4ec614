"""Login-node input checks: every bad model folder or data file is one InputError naming FILE:LINE."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from specs import write_spec

from fsdpjob.orchestrator.core.errors import InputError
from fsdpjob.orchestrator.core.inputs.checks import check_inputs
from fsdpjob.orchestrator.core.inputs.records import SCAN_LINES
from fsdpjob.orchestrator.core.jobspec.families import SUPPORTED_MODEL_TYPES
from fsdpjob.orchestrator.core.jobspec.spec import load_spec

SPEC = """\
name: inputs-test
model:
  path: model
data:
  path: data.jsonl
  seq_len: 128
{extra_data}train:
  max_steps: 10
"""


def make_model(folder: Path, *, model_type: str = "llama", max_pos: int = 512, chat: bool = True) -> Path:
    """A model folder with the files check_inputs looks at (contents are not loaded on the login node)."""
    folder.mkdir(parents=True, exist_ok=True)
    config = {"model_type": model_type, "architectures": ["LlamaForCausalLM"], "max_position_embeddings": max_pos}
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "model.safetensors").write_bytes(b"")
    (folder / "tokenizer.json").write_text("{}")
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ x }}"} if chat else {}))
    return folder


def write_inputs(tmp_path: Path, lines: list[str] | None = None, extra_data: str = "") -> tuple:
    """Spec + model folder + data file in tmp_path; returns (spec, doc, data_path)."""
    make_model(tmp_path / "model")
    data = tmp_path / "data.jsonl"
    data.write_text("".join(line + "\n" for line in (lines if lines is not None else ['{"text": "a"}'])))
    spec, doc = load_spec(write_spec(tmp_path / "job.yaml", SPEC.format(extra_data=extra_data)))
    return spec, doc, data


def expect_error(spec, doc, *parts: str) -> InputError:
    with pytest.raises(InputError) as info:
        check_inputs(spec, doc)
    text = str(info.value)
    assert "\n" not in text
    for part in parts:
        assert part in text, text
    return info.value


def test_good_inputs_pass(tmp_path):
    spec, doc, _ = write_inputs(tmp_path)
    check_inputs(spec, doc)
    check_inputs(spec)  # without the YAML document too


def test_model_folder_missing_points_at_spec_line(tmp_path):
    spec, doc, _ = write_inputs(tmp_path)
    for child in (tmp_path / "model").iterdir():
        child.unlink()
    (tmp_path / "model").rmdir()
    err = expect_error(spec, doc, "does not exist", "model.path")
    assert (err.file, err.line, err.loc) == (doc.file, 3, "model.path")
    assert str(err).startswith(f"{doc.file}:3: model.path: model folder ")


def test_model_path_is_a_file(tmp_path):
    spec, doc, _ = write_inputs(tmp_path)
    spec = spec.model_copy(update={"model": spec.model.model_copy(update={"path": str(tmp_path / "data.jsonl")})})
    expect_error(spec, doc, "is not a folder")


def test_config_json_malformed_names_its_line(tmp_path):
    spec, doc, _ = write_inputs(tmp_path)
    (tmp_path / "model" / "config.json").write_text('{\n  "model_type": "llama",\n  oops\n}')
    err = expect_error(spec, doc, "config.json is not valid JSON")
    assert (err.file, err.line) == (str(tmp_path / "model" / "config.json"), 3)


def test_unsupported_architecture_lists_supported(tmp_path):
    spec, doc, _ = write_inputs(tmp_path)
    make_model(tmp_path / "model", model_type="t5")
    err = expect_error(spec, doc, "model_type 't5'", "not supported", "llama, mistral", "qwen2", "gpt2",
                       "_no_split_modules")
    assert err.loc == "model.path"


def test_not_a_causal_lm(tmp_path):
    spec, doc, _ = write_inputs(tmp_path)
    config = {"model_type": "llama", "architectures": ["LlamaForSequenceClassification"]}
    (tmp_path / "model" / "config.json").write_text(json.dumps(config))
    expect_error(spec, doc, "no *ForCausalLM")


@pytest.mark.parametrize(
    "remove, add, words",
    [
        ("config.json", None, "no config.json"),
        # Before the download: the way to check the spec anyway is named.
        ("model.safetensors", None, "download them first; before that, `fsdpjob plan` needs only config.json and "
                                    "--no-file-checks skips these checks"),
        ("model.safetensors", "pytorch_model.bin", "only PyTorch .bin weights; convert them to safetensors"),
        ("tokenizer.json", None, "no tokenizer in"),
        ("tokenizer.json", "tokenizer.model", None),  # a sentencepiece model with tokenizer_config.json is enough
    ],
)
def test_model_folder_files(tmp_path, remove, add, words):
    spec, doc, _ = write_inputs(tmp_path)
    (tmp_path / "model" / remove).unlink()
    if add:
        (tmp_path / "model" / add).write_bytes(b"")
    if words is None:
        check_inputs(spec, doc)
        return
    err = expect_error(spec, doc, words)
    assert (err.file, err.line, err.loc) == (doc.file, 3, "model.path")


def test_sharded_index_with_missing_shard(tmp_path):
    spec, doc, _ = write_inputs(tmp_path)
    model = tmp_path / "model"
    (model / "model.safetensors").rename(model / "model-00001-of-00002.safetensors")
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (model / "model.safetensors.index.json").write_text(json.dumps(index))
    expect_error(spec, doc, "1 missing shard", "model-00002-of-00002.safetensors")


def test_chat_data_needs_a_chat_template(tmp_path):
    line = '{"messages": [{"role": "user", "content": "hi"}]}'
    spec, doc, _ = write_inputs(tmp_path, [line], "  messages_field: messages\n")
    check_inputs(spec, doc)
    make_model(tmp_path / "model", chat=False)
    err = expect_error(spec, doc, "needs a chat template")
    assert (err.loc, err.line) == ("data.messages_field", 7)


def test_seq_len_beyond_max_positions(tmp_path):
    spec, doc, _ = write_inputs(tmp_path)
    make_model(tmp_path / "model", max_pos=64)
    err = expect_error(spec, doc, "data.seq_len 128", "max_position_embeddings 64", "at most 64")
    assert (err.loc, err.line) == ("data.seq_len", 6)


def test_data_file_missing(tmp_path):
    spec, doc, data = write_inputs(tmp_path)
    data.unlink()
    err = expect_error(spec, doc, "does not exist")
    assert (err.loc, err.line) == ("data.path", 5)


def test_data_file_empty(tmp_path):
    spec, doc, _ = write_inputs(tmp_path, [])
    expect_error(spec, doc, "is empty")


def test_data_file_only_blank_lines(tmp_path):
    spec, doc, _ = write_inputs(tmp_path, ["", "   "])
    expect_error(spec, doc, "no examples")


@pytest.mark.parametrize(
    "lines, line, words",
    [
        (['{"text": "a"}', "", '{"text": "b"', '{"text": "c"}'], 3, "malformed JSON"),
        (['{"text": "a"}', '{"body": "b"}'], 2, "missing field 'text' (set by data.text_field); this line has 'body'"),
        (['{"text": 5}'], 1, "field 'text': expected a string, found a number"),
        (['["text"]'], 1, "expected a JSON object, found an array"),
    ],
)
def test_bad_data_line_names_file_and_line(tmp_path, lines, line, words):
    spec, doc, data = write_inputs(tmp_path, lines)
    err = expect_error(spec, doc, words)
    assert (err.file, err.line) == (str(data), line)
    assert str(err).startswith(f"{data}:{line}: ")


def test_bad_utf8_line(tmp_path):
    spec, doc, data = write_inputs(tmp_path)
    data.write_bytes(b'{"text": "ok"}\n{"text": "\xff"}\n')
    err = expect_error(spec, doc, "not valid UTF-8")
    assert err.line == 2


def test_prompt_completion_fields_checked(tmp_path):
    extra = "  prompt_field: q\n  completion_field: a\n"
    spec, doc, _ = write_inputs(tmp_path, ['{"q": "1+1", "a": "2"}', '{"q": "2+2"}'], extra)
    err = expect_error(spec, doc, "missing field 'a' (set by data.completion_field)")
    assert err.line == 2


@pytest.mark.parametrize(
    "messages, words",
    [
        ('"hi"', "expected a list of {role, content} objects, found a string"),
        ("[]", "the conversation is empty"),
        ('[{"role": "user"}]', "message 0 has no 'content'"),
        ('[{"role": "user", "content": "a"}, {"role": 1, "content": "b"}]', "message 1: 'role' must be a string"),
    ],
)
def test_bad_messages(tmp_path, messages, words):
    spec, doc, _ = write_inputs(tmp_path, [f'{{"messages": {messages}}}'], "  messages_field: messages\n")
    err = expect_error(spec, doc, words)
    assert err.line == 1


def test_scans_only_the_first_lines(tmp_path):
    lines = ['{"text": "a"}'] * SCAN_LINES + ["not json"]
    spec, doc, _ = write_inputs(tmp_path, lines)
    check_inputs(spec, doc)  # line SCAN_LINES + 1 is the worker's to find


def test_supported_families_are_decoder_only():
    assert {"llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "phi3", "olmo", "olmo2", "granite", "mixtral",
            "gpt2", "gpt_neox", "falcon"} <= set(SUPPORTED_MODEL_TYPES)  # fmt: skip
    assert not {"t5", "bert", "bart"} & set(SUPPORTED_MODEL_TYPES)


def test_no_torch_on_the_login_node():
    code = ("import sys, fsdpjob.orchestrator.core.inputs.checks; "
            "assert not {'torch', 'transformers'} & set(sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_every_file_problem_is_reported_at_once(tmp_path):
    """No weights, no tokenizer and no data file: three lines, not the first one only (as the README promises)."""
    from fsdpjob.orchestrator.core.jobspec.validation import SpecErrors

    spec, doc, data = write_inputs(tmp_path)
    for name in ("model.safetensors", "tokenizer.json"):
        (tmp_path / "model" / name).unlink()
    data.unlink()
    with pytest.raises(SpecErrors) as info:
        check_inputs(spec, doc)
    lines = info.value.format().splitlines()
    assert [(e.line, e.loc) for e in info.value.errors] == [(3, "model.path"), (3, "model.path"), (5, "data.path")]
    assert "no weights in" in lines[0] and "no tokenizer in" in lines[1] and "does not exist" in lines[2]


def test_an_env_path_without_srun_is_refused_on_a_slurm_profile(tmp_path, monkeypatch):
    """The supervisor runs srun and scontrol after the job's env is exported: a PATH none of whose folders has srun
    (where this machine's PATH has one) would fail on the node, after the queue."""
    from fsdpjob.orchestrator.core.jobspec.validation import SpecErrors
    from fsdpjob.orchestrator.planner.jobload import check_environment, load_job

    bin_dir = tmp_path / "slurm-bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text("#!/bin/sh\n")
    (bin_dir / "srun").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    monkeypatch.setenv("MY_BIN", str(bin_dir))
    spec = write_spec(tmp_path / "job.yaml", {"name": "p", "profile": "h100", "env": {"PATH": "/opt/tools/bin"},
                                              "model": {"path": "/m"}, "data": {"path": "/d.jsonl"},
                                              "train": {"max_steps": 10}})
    job = load_job(str(spec), check_files=False)
    with pytest.raises(SpecErrors) as err:
        check_environment(job.spec, job.profile, job.doc)
    assert err.value.format() == (f"{spec}:4: env.PATH: no folder of this PATH has srun (here it is in {bin_dir}): "
                                  "the job's supervisor could not run srun or scontrol; add "
                                  f"{bin_dir}, or extend the PATH: $PATH:/my/bin")
    for fine in ("/opt/tools/bin:$PATH", "${MY_BIN}", f"/opt/tools/bin:{bin_dir}"):
        job = load_job(str(spec), overrides=(f"env.PATH={fine}",), check_files=False)
        check_environment(job.spec, job.profile, job.doc)
    job = load_job(str(spec), profile="local", check_files=False)  # no Slurm command runs there
    check_environment(job.spec, job.profile, job.doc)
