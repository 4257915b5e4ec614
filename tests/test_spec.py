"""The job spec: Slurm times, YAML traps, one-line errors at the right FILE:LINE, cross-field arithmetic, overrides."""

from __future__ import annotations

from pathlib import Path

import pytest

from fsdpjob.orchestrator.core.errors import InputError, SpecError
from fsdpjob.orchestrator.core.jobspec.profiles import load_profile
from fsdpjob.orchestrator.core.jobspec.spec import JobSpec, load_spec
from fsdpjob.orchestrator.core.jobspec.validation import SpecErrors
from fsdpjob.orchestrator.core.jobspec.yamlio import apply_overrides
from fsdpjob.orchestrator.core.slurmtime import format_slurm_time, parse_slurm_time
from fsdpjob.orchestrator.planner.jobload import load_job
from fsdpjob.orchestrator.planner.resolve import check

REPO = Path(__file__).resolve().parents[1]
VALID = REPO / "tests" / "data" / "specs" / "valid"
BASE = """\
name: unit
profile: test-cluster
model:
  path: /m
data:
  path: /d.jsonl
train:
  max_steps: 10
"""


def write(tmp_path: Path, text: str, name: str = "job.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def errors_of(path: Path, overrides: tuple[str, ...] = (), profile: str | None = None) -> list[InputError]:
    """Every error load_job reports, each checked to be one line."""
    with pytest.raises(InputError) as info:
        load_job(str(path), profile=profile, overrides=overrides, check_files=False)
    found = info.value.errors if isinstance(info.value, SpecErrors) else [info.value]
    for err in found:
        assert "\n" not in err.format(), err.format()
    return found


def only_error(path: Path, overrides: tuple[str, ...] = (), profile: str | None = None) -> InputError:
    found = errors_of(path, overrides, profile)
    assert len(found) == 1, [e.format() for e in found]
    return found[0]


# --- Slurm times -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, seconds",
    [
        ("90", 90 * 60),  # MM
        ("0", None),
        ("5:30", 5 * 60 + 30),  # MM:SS
        ("1:30:00", 5400),  # HH:MM:SS
        ("100:00:00", 100 * 3600),
        ("2-0", 2 * 86400),  # D-HH
        ("1-12", 86400 + 12 * 3600),
        ("1-2:30", 86400 + 2 * 3600 + 30 * 60),  # D-HH:MM
        ("3-04:05:06", 3 * 86400 + 4 * 3600 + 5 * 60 + 6),  # D-HH:MM:SS
        (45, 45 * 60),
    ],
)
def test_slurm_time_formats(text, seconds):
    if seconds is None:
        with pytest.raises(ValueError, match="zero"):
            parse_slurm_time(text)
        return
    assert parse_slurm_time(text) == seconds
    assert parse_slurm_time(format_slurm_time(seconds)) == seconds


@pytest.mark.parametrize(
    "text",
    ["", "abc", "1h", "1:60", "1:2:60", "1:60:00", "1-24", "1-1:60", "-5", "1.5", "1:30:00:00", "1--2", "2-", " - "],
)
def test_bad_slurm_times_are_rejected_with_the_formats(text):
    with pytest.raises(ValueError) as info:
        parse_slurm_time(text)
    message = str(info.value)
    assert "out of range" in message or "D-HH:MM:SS" in message


def test_format_is_canonical():
    assert format_slurm_time(59) == "00:00:59"
    assert format_slurm_time(5400) == "01:30:00"
    assert format_slurm_time(86400 + 61) == "1-00:01:01"


def test_unquoted_clock_times_stay_times_not_base_60_numbers(tmp_path):
    """YAML 1.1 reads 30:00 as 1800; fsdpjob must read it as 30 minutes, in files and in --set."""
    spec, _ = load_spec(write(tmp_path, BASE + "resources:\n  time_limit: 30:00\n"))
    assert spec.resources.time_limit_s == 30 * 60
    spec, _ = load_spec(write(tmp_path, BASE + "resources:\n  time_limit: 1:30:00\n"))
    assert spec.resources.time_limit_s == 5400
    spec, _ = load_spec(write(tmp_path, BASE), ["resources.time_limit=1:30:00"])
    assert spec.resources.time_limit_s == 5400
    spec, _ = load_spec(write(tmp_path, BASE + "resources:\n  time_limit: 90\n"))
    assert spec.resources.time_limit_s == 90 * 60


def test_bad_time_limit_points_at_its_line(tmp_path):
    err = only_error(write(tmp_path, BASE + "resources:\n  nodes: 1\n  time_limit: 1:61:00\n"))
    assert (err.line, err.loc) == (11, "resources.time_limit")
    err = only_error(write(tmp_path, BASE + "resources:\n  time_limit: tomorrow\n"))
    assert err.line == 10 and "D-HH:MM:SS" in err.message


# --- one-line errors with FILE:LINE ------------------------------------------------------------------------------


def test_unknown_key_suggests_the_closest(tmp_path):
    err = only_error(write(tmp_path, BASE.replace("  max_steps: 10\n", "  max_steps: 10\n  max_step: 3\n")))
    assert err.format() == f"{tmp_path / 'job.yaml'}:9: train.max_step: unknown key; did you mean 'max_steps'?"
    err = only_error(write(tmp_path, BASE + "resource:\n  nodes: 2\n"))
    assert (err.line, err.loc) == (9, "resource") and "'resources'" in err.message


def test_unknown_key_without_a_close_match_lists_the_valid_ones(tmp_path):
    err = only_error(write(tmp_path, BASE + "fsdp:\n  zzz: 1\n"))
    assert "valid keys:" in err.message and "replicate_degree" in err.message


@pytest.mark.parametrize(
    "extra, line, loc, words",
    [
        ("resources:\n  nodes: two\n", 10, "resources.nodes", "valid integer"),
        ("resources:\n  nodes: 0\n", 10, "resources.nodes", "greater than 0"),
        ("resources:\n  nodes: -3\n", 10, "resources.nodes", "greater than 0"),
        ("resources:\n  cpus_per_task: 0\n", 10, "resources.cpus_per_task", "greater than 0"),
        ("resources:\n  mem_per_node: lots\n", 10, "resources.mem_per_node", "500G"),
        ("resources:\n  mem_per_node: true\n", 10, "resources.mem_per_node", "not a Slurm memory size"),
        ("resources:\n  mem_per_node: 1.5\n", 10, "resources.mem_per_node", "not a Slurm memory size"),
        ("fsdp:\n  replicate_degree: 0\n", 10, "fsdp.replicate_degree", "greater than 0"),
        ("fsdp:\n  mixed_precision: fp8\n", 10, "fsdp.mixed_precision", "'bf16' or 'fp32'"),
        ("fsdp:\n  cpu_offload: maybe\n", 10, "fsdp.cpu_offload", "valid boolean"),
        ("checkpoint:\n  keep_last: 0\n", 10, "checkpoint.keep_last", "greater than 0"),
        ("preemption:\n  signal: KILL\n", 10, "preemption.signal", "USR2"),
        ("preemption:\n  signal_lead_s: -1\n", 10, "preemption.signal_lead_s", "greater than 0"),
        ("env:\n  1BAD: x\n", 9, "env", "not a valid environment variable name"),
        ("env:\n  GOOD: [1]\n", 10, "env.GOOD", "valid string"),
        ("secret_env: [NOPE]\n", 9, "secret_env", "are not in env"),
    ],
)
def test_wrong_values_point_at_their_line(tmp_path, extra, line, loc, words):
    err = only_error(write(tmp_path, BASE + extra))
    assert (err.line, err.loc) == (line, loc), err.format()
    assert words in err.message, err.message


@pytest.mark.parametrize("given, stored", [("0", "0"), ("64000", "64000"), ("500G", "500G"), ("'2T'", "2T")])
def test_memory_sizes_accept_plain_numbers(tmp_path, given, stored):
    spec, _ = load_spec(write(tmp_path, BASE + f"resources:\n  mem_per_node: {given}\n"))
    assert spec.resources.mem_per_node == stored


def test_train_section_errors(tmp_path):
    text = BASE.replace("  max_steps: 10\n", "  max_steps: -5\n  lr: fast\n  warmup_steps: 2\n")
    found = {e.loc: e for e in errors_of(write(tmp_path, text))}
    assert found["train.max_steps"].line == 8 and "greater than 0" in found["train.max_steps"].message
    assert found["train.lr"].line == 9 and "'fast'" in found["train.lr"].message
    err = only_error(write(tmp_path, BASE.replace("  max_steps: 10\n", "  max_steps: 10\n  warmup_steps: 10\n")))
    assert err.loc == "train" and "warmup_steps (10) must be below max_steps (10)" in err.message


def test_missing_required_fields_point_at_their_section(tmp_path):
    err = only_error(write(tmp_path, BASE.replace("  max_steps: 10\n", "  lr: 0.1\n")))
    assert (err.line, err.loc) == (7, "train.max_steps") and "required" in err.message
    found = errors_of(write(tmp_path, "name: x\n"))
    assert {e.loc for e in found} == {"model", "data", "train"}


@pytest.mark.parametrize("name", ["my job", "-lead", "a/b", "", "x" * 65, "naïve", "a;b"])
def test_bad_names(tmp_path, name):
    err = only_error(write(tmp_path, BASE.replace("name: unit", f"name: {name!r}")))
    assert (err.line, err.loc) == (1, "name") and "letters, digits" in err.message


def test_several_errors_are_one_line_each(tmp_path):
    path = write(tmp_path, BASE + "resources:\n  nodes: 0\n  gpus_per_node: x\n")
    with pytest.raises(SpecErrors) as info:
        load_job(str(path), check_files=False)
    lines = info.value.format().splitlines()
    assert len(lines) == 2 and all(line.startswith(f"{path}:1") for line in lines)


@pytest.mark.parametrize(
    "text, line, words",
    [
        ("name: a\nname: b\n", 2, "duplicate key 'name' (first at line 1)"),
        ("name: a\nmodel: [\n", 3, "YAML syntax error"),
        ("name: a\n\tx: 1\n", 2, "YAML syntax error"),
        ("", 1, "the file is empty"),
        ("- a\n", 1, "expected a YAML mapping"),
    ],
)
def test_yaml_problems(tmp_path, text, line, words):
    err = only_error(write(tmp_path, text))
    assert err.line == line and words in err.message, err.format()


def test_nul_and_control_characters_in_paths_are_clear_errors(tmp_path):
    text = BASE.replace("path: /m", 'path: "/m\\0x"') + 'checkpoint:\n  dir: "ck\\0pt"\n'
    found = {e.loc: e for e in errors_of(write(tmp_path, text))}
    assert set(found) == {"model.path", "checkpoint.dir"}
    assert all("control characters" in e.message for e in found.values())
    err = only_error(write(tmp_path, BASE.replace("path: /d.jsonl", 'path: "/d\\n.jsonl"')))
    assert err.loc == "data.path"


def test_paths_resolve_against_the_spec_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "sub").mkdir()
    text = BASE.replace("path: /m", "path: ../models/m").replace("path: /d.jsonl", "path: ~/d.jsonl")
    spec, _ = load_spec(write(tmp_path / "sub", text + "checkpoint:\n  dir: ~nosuchuser-xyz/ck\n"))
    assert spec.model.path == str(tmp_path / "models" / "m")
    assert spec.data.path == str(tmp_path / "home" / "d.jsonl")
    assert spec.checkpoint.dir == str(tmp_path / "sub" / "~nosuchuser-xyz" / "ck")


# --- cross-field rules print the arithmetic ----------------------------------------------------------------------


def cross_errors(tmp_path: Path, extra: str, profile: str = "test-cluster") -> list[InputError]:
    spec, doc = load_spec(write(tmp_path, BASE + extra))
    with pytest.raises(SpecErrors) as info:
        check(spec, load_profile(profile), doc)
    return info.value.errors


def test_world_size_not_divisible_by_replicate_degree(tmp_path):
    (err,) = cross_errors(tmp_path, "resources:\n  nodes: 3\nfsdp:\n  replicate_degree: 4\n")
    assert (err.line, err.loc) == (12, "fsdp.replicate_degree")
    assert "world size = nodes (3) x tasks_per_node (2) = 6, not divisible by replicate_degree (4)" in err.message


def test_time_limit_above_profile_max_time(tmp_path):
    (err,) = cross_errors(tmp_path, "resources:\n  time_limit: 1-00:00:01\n")
    assert (err.line, err.loc) == (10, "resources.time_limit")
    expected = "1-00:00:01 (1-00:00:01 = 86401 s) exceeds profile 'test-cluster' max_time 1-00:00:00 (86400 s)"
    assert expected in err.message


def test_signal_lead_not_shorter_than_time_limit(tmp_path):
    (err,) = cross_errors(tmp_path, "resources:\n  time_limit: 2\npreemption:\n  signal_lead_s: 120\n")
    assert (err.line, err.loc) == (12, "preemption.signal_lead_s")
    assert "signal lead 120 s is not shorter than the time limit 120 s" in err.message


def test_tasks_per_node_must_match_gpus(tmp_path):
    (err,) = cross_errors(tmp_path, "resources:\n  tasks_per_node: 3\n")  # the profile has 2 GPUs per node
    assert (err.line, err.loc) == (10, "resources.tasks_per_node")
    assert "tasks_per_node (3) must equal gpus_per_node (2, from profile 'test-cluster')" in err.message
    err = only_error(write(tmp_path, BASE + "resources:\n  gpus_per_node: 2\n  tasks_per_node: 4\n"))
    assert err.loc == "resources" and "tasks_per_node (4) must equal gpus_per_node (2)" in err.message


def test_more_gpus_than_the_nodes_have(tmp_path):
    (err,) = cross_errors(tmp_path, "resources:\n  gpus_per_node: 4\n")
    assert err.loc == "resources.gpus_per_node" and "4 GPUs per node requested" in err.message


def test_local_profile_is_one_node(tmp_path):
    (err,) = cross_errors(tmp_path, "resources:\n  nodes: 2\n", profile="local")
    assert err.loc == "resources.nodes" and "nodes must be at most 1, got 2" in err.message


def test_cpu_profile_allows_several_tasks(tmp_path):
    spec, doc = load_spec(write(tmp_path, BASE + "resources:\n  tasks_per_node: 2\n"))
    assert check(spec, load_profile("local"), doc).world_size == 2


# --- --set overrides ---------------------------------------------------------------------------------------------


def test_overrides_parse_values_as_yaml():
    items = ["train.lr=3e-4", "train.betas=[0.8, 0.9]", "fsdp.cpu_offload=true", "name=it's", "env.EMPTY=",
             "resources.time_limit=2:00:00"]  # fmt: skip
    data = apply_overrides({"train": {"lr": 1}}, items)
    assert data["train"] == {"lr": 3e-4, "betas": [0.8, 0.9]}  # 3e-4 is a float without a dot too (as in YAML 1.2)
    assert data["fsdp"] == {"cpu_offload": True} and data["name"] == "it's" and data["env"] == {"EMPTY": ""}
    assert data["resources"]["time_limit"] == "2:00:00"


@pytest.mark.parametrize(
    "item, words",
    [("noequals", "expected KEY=VALUE"), ("=1", "bad key"), ("train..lr=1", "bad key"), ("name.x=1", "not a section")],
)
def test_bad_overrides(item, words):
    with pytest.raises(InputError) as info:
        apply_overrides({"name": "a"}, [item])
    assert info.value.file == "--set" and words in info.value.message


def test_override_with_an_unknown_key_suggests_the_closest(tmp_path):
    err = only_error(write(tmp_path, BASE), overrides=("train.max_stepz=5",))
    assert err.loc == "train.max_stepz" and "did you mean 'max_steps'?" in err.message
    spec = load_job(str(write(tmp_path, BASE)), overrides=("train.lr=1e-3", "resources.nodes=2"), check_files=False)
    assert spec.spec.train.lr == 1e-3 and spec.eff.world_size == 4


# --- hashing and secrets -----------------------------------------------------------------------------------------


def test_secret_env_is_redacted_and_outside_the_hash(tmp_path):
    text = BASE + "env:\n  HF_TOKEN: abc\n  PLAIN: x\n  MY_PASS: y\nsecret_env: [MY_PASS]\n"
    spec, _ = load_spec(write(tmp_path, text))
    assert spec.secret_names() == {"HF_TOKEN", "MY_PASS"}
    assert spec.public_env() == {"PLAIN": "x"}
    assert spec.redacted().env == {"HF_TOKEN": "<secret>", "PLAIN": "x", "MY_PASS": "<secret>"}
    other, _ = load_spec(write(tmp_path, text.replace("abc", "other-token"), "b.yaml"))
    assert spec.spec_hash() == other.spec_hash()
    changed, _ = load_spec(write(tmp_path, text.replace("PLAIN: x", "PLAIN: z"), "c.yaml"))
    assert changed.spec_hash() != spec.spec_hash()


def test_dtype_fields_take_both_spellings_and_hash_as_their_own(tmp_path):
    own = "model:\n  path: /m\n  dtype: {m}\nfsdp:\n  mixed_precision: {p}\n  reduce_dtype: {r}\n"
    base = BASE.replace("model:\n  path: /m\n", "").replace("train:\n  max_steps: 10\n",
                                                             "train:\n  max_steps: 10\n  optimizer_state_dtype: {o}\n")
    canonical = dict(m="bfloat16", p="fp32", r="bfloat16", o="float32")
    spec, _ = load_spec(write(tmp_path, own.format(**canonical) + base.format(**canonical)))
    other = dict(m="bf16", p="float32", r="bf16", o="fp32")  # each field in the other fields' words
    swapped, _ = load_spec(write(tmp_path, own.format(**other) + base.format(**other), "b.yaml"))
    assert (swapped.model.dtype, swapped.fsdp.mixed_precision, swapped.fsdp.reduce_dtype,
            swapped.train.optimizer_state_dtype) == ("bfloat16", "fp32", "bfloat16", "float32")
    assert swapped.spec_hash() == spec.spec_hash()
    overridden, _ = load_spec(write(tmp_path, BASE, "c.yaml"), ["fsdp.mixed_precision=bfloat16", "model.dtype=fp32"])
    assert (overridden.fsdp.mixed_precision, overridden.model.dtype) == ("bf16", "float32")
    errors = errors_of(write(tmp_path, BASE + "fsdp:\n  mixed_precision: fp16\n", "d.yaml"))
    assert [e.loc for e in errors] == ["fsdp.mixed_precision"]


def test_spec_is_frozen(tmp_path):
    spec, _ = load_spec(write(tmp_path, BASE))
    with pytest.raises(Exception):  # noqa: B017 - pydantic raises its ValidationError for a frozen model
        spec.train.max_steps = 5  # type: ignore[misc]


# --- shipped examples and sample specs ---------------------------------------------------------------------------


@pytest.mark.parametrize("path", sorted((REPO / "examples").glob("*.yaml")), ids=lambda p: p.name)
def test_every_example_validates(path):
    job = load_job(str(path), check_files=False)  # the quickstart assets are made by `fsdpjob quickstart`
    assert isinstance(job.spec, JobSpec)


@pytest.mark.parametrize("path", sorted(VALID.glob("*.yaml")), ids=lambda p: p.name)
def test_sample_specs_validate(path):
    load_job(str(path), check_files=False)


def test_spec_error_is_an_input_error():
    err = SpecError("bad", file="f.yaml", line=3, loc="a.b")
    assert err.format() == "f.yaml:3: a.b: bad" and err.exit_code == 2
    assert SpecError("x\ny", file="f").format() == "f: x\\ny"
