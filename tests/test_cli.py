"""The real `fsdpjob` CLI in a subprocess: exit codes, one-line FILE:LINE errors on stderr, stdout for results."""

from __future__ import annotations

import json
import re
import sys
from functools import partial
from pathlib import Path

import helpers
import pytest
from specs import llama2_70b_spec
from specs import write_spec as write_spec_file

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
INVALID = TESTS / "data" / "specs" / "invalid"
VALID = TESTS / "data" / "specs" / "valid"
GOLDEN = TESTS / "golden"
GOLDEN_PYTHON = "/opt/fsdpjob/venv/bin/python"  # what test_render puts in the goldens for sys.executable
# Run from the repository root (the specs are named relative to it); nothing here takes more than seconds.
fsdpjob = partial(helpers.fsdpjob, cwd=REPO, timeout_s=60)
# The variables the valid specs name in `env` ($SCRATCH, $USER): the environment is checked with or without
# --no-file-checks, as it is where a user submits.
SPEC_VARS = {"SCRATCH": "/scratch", "USER": "someone"}


def header(path: Path, key: str) -> str | None:
    """The value of a '# key: value' line at the top of a sample spec."""
    match = re.search(rf"^# {key}: (.*)$", path.read_text(), re.MULTILINE)
    return match.group(1) if match else None


def invalid_cases() -> list:
    cases = []
    for path in sorted(INVALID.glob("*.yaml")):
        reason = header(path, "xfail")
        marks = [pytest.mark.xfail(reason=reason, strict=True)] if reason else []
        cases.append(pytest.param(path, marks=marks, id=path.stem))
    return cases


@pytest.mark.parametrize("path", invalid_cases())
def test_invalid_spec_gives_one_line_at_file_line(path):
    """tests/data/specs/invalid/*.yaml: each '# expect: LINE: field: message' is one line `validate` must print
    (a spec with several problems has them all reported, one line each)."""
    expects = re.findall(r"^# expect: (.*)$", path.read_text(), re.MULTILINE)
    assert expects, f"{path.name} has no '# expect:' line"
    rel = path.relative_to(REPO).as_posix()
    done = fsdpjob("validate", rel, *(header(path, "args") or "").split())
    assert done.returncode == 2, (done.returncode, done.stdout, done.stderr)
    assert done.stdout == ""
    lines = done.stderr.splitlines()
    assert len(lines) == len(expects), done.stderr
    for expect, got in zip(expects, lines):
        line, _, rest = expect.partition(": ")
        prefix = f"{rel}:{line}: "
        assert got.startswith(prefix), f"expected {prefix!r}...: {got}"
        loc_and_message = got[len(prefix) :]
        if rest.startswith("YAML"):
            assert loc_and_message.startswith(rest), got
        else:
            loc, _, message = rest.partition(": ")
            assert loc_and_message.startswith(f"{loc}: ") and message in loc_and_message, got


def test_valid_specs_validate(tmp_path):
    paths = [p.relative_to(REPO).as_posix() for p in sorted(VALID.glob("*.yaml"))]
    done = fsdpjob("validate", *paths, "--no-file-checks", env=SPEC_VARS)
    # Off a cluster (no sinfo answer), a multi-node Slurm spec gets the one warning that its partition's size is
    # unknown; nothing else.
    assert done.returncode == 0 and all(": partition size unknown: " in line for line in done.stderr.splitlines())
    assert [line.split(":")[0] for line in done.stdout.splitlines()] == paths
    assert all(": ok (profile " in line for line in done.stdout.splitlines())


def test_a_partition_size_nobody_knows_is_a_warning_not_a_silent_fit(tmp_path):
    """No shipped Slurm profile sets partition_nodes: off the cluster (sinfo cannot answer), 100000 nodes planned
    FITS without a word. Slurm's partition_size is made to answer None, as it does off a cluster."""
    spec = llama2_70b_spec(tmp_path, 100000)
    stub = tmp_path / "stub"
    stub.mkdir()
    (stub / "sinfo").write_text("#!/bin/sh\nexit 1\n")
    (stub / "sinfo").chmod(0o755)
    env = {"PATH": f"{stub}:/usr/bin:/bin"}
    done = fsdpjob("plan", str(spec), "--json", env=env)
    warnings = json.loads(done.stdout)["warnings"]
    assert any(w.startswith("partition size unknown: 100000 nodes are not checked against partition gpu (profile "
                            "'a100-80gb' sets no partition_nodes for it") for w in warnings), warnings
    done = fsdpjob("validate", str(spec), "--no-file-checks", env=env)
    assert done.returncode == 0
    assert done.stderr.startswith(f"warning: {spec}: partition size unknown: 100000 nodes"), done.stderr
    one = fsdpjob("validate", str(spec), "--no-file-checks", "--set", "resources.nodes=1", env=env)
    assert one.returncode == 0 and one.stderr == "", one.stderr  # one node fits any partition


def test_validate_reports_every_bad_spec_and_fails():
    good = "tests/data/specs/valid/single-node.yaml"
    bad = ["tests/data/specs/invalid/zero-nodes.yaml", "tests/data/specs/invalid/negative-steps.yaml"]
    done = fsdpjob("validate", good, *bad, "--no-file-checks")
    assert done.returncode == 2
    assert done.stdout.startswith(f"{good}: ok")
    assert [line.split(":")[0] for line in done.stderr.splitlines()] == bad


def test_missing_spec_file():
    done = fsdpjob("validate", "no/such/spec.yaml")
    assert done.returncode == 2 and done.stderr.strip() == "no/such/spec.yaml: file not found; check the path"


# --- --set -------------------------------------------------------------------------------------------------------

SPEC = "tests/data/specs/valid/single-node.yaml"


def test_set_overrides_values_as_yaml():
    done = fsdpjob("validate", SPEC, "--no-file-checks", "--set", "resources.nodes=2", "--set", "train.lr=1e-4")
    assert done.returncode == 0 and "world size 4" in done.stdout, done.stderr
    done = fsdpjob("render", SPEC, "--no-file-checks", "--run-dir", "/runs/x", "--set", "resources.time_limit=1:30:00")
    assert done.returncode == 0 and "#SBATCH --time=01:30:00\n" in done.stdout


@pytest.mark.parametrize(
    "item, expected",
    [
        # The value came from --set, not from the spec's line: the error says so.
        ("train.max_stepz=5", "--set train.max_stepz=5: train.max_stepz: unknown key; did you mean 'max_steps'?"),
        ("resources.nodes=0", "--set resources.nodes=0: resources.nodes: Input should be greater than 0"),
        ("resources.nodes=[1, 2]", "--set resources.nodes=[1, 2]: resources.nodes: Input should be a valid integer "
                                   "(got [1, 2])"),
        ("fsdp=5", "--set fsdp=5: fsdp: expected a section (indented key: value lines), got 5"),
        ("train.betas=[0.9]", "--set train.betas=[0.9]: train.betas: betas takes two numbers (beta1, beta2), e.g. "
                              "[0.9, 0.95]; got 1"),
        ("resources.nodes=true", "--set resources.nodes=true: resources.nodes: Input should be a valid integer "
                                 "(got True)"),
        ("name.first=x", "--set: 'name' is not a section; cannot set 'name.first'"),
        ("nodes", "--set: expected KEY=VALUE (e.g. train.lr=1e-4), got 'nodes'"),
        ("train..lr=1", "--set: bad key 'train..lr'; use dotted field names such as train.max_steps"),
    ],
)
def test_bad_set(item, expected):
    done = fsdpjob("validate", SPEC, "--no-file-checks", "--set", item)
    assert (done.returncode, done.stderr.strip()) == (2, expected)


def test_profile_option_overrides_the_spec():
    done = fsdpjob("validate", SPEC, "--no-file-checks", "--profile", "h100")
    assert done.returncode == 0 and "(profile h100, world size 8," in done.stdout
    done = fsdpjob("validate", SPEC, "--no-file-checks", "--profile", "nope")
    assert done.returncode == 2 and "valid profiles are: a100-80gb, cpu-oci, example" in done.stderr
    assert len(done.stderr.splitlines()) == 1


# --- file checks (a minimal model folder; nothing is loaded) -----------------------------------------------------


def write_job_with_files(tmp_path: Path, *, data: bool = True) -> Path:
    helpers.tiny_model_folder(tmp_path / "model")
    if data:
        (tmp_path / "data.jsonl").write_text('{"text": "1+1=2"}\n')
    spec = tmp_path / "job.yaml"
    spec.write_text("name: files\nprofile: test-cluster\nmodel:\n  path: model\ndata:\n  path: data.jsonl\n"
                    "  seq_len: 128\ntrain:\n  max_steps: 5\n")  # fmt: skip
    return spec


def test_file_checks_pass_on_real_files(tmp_path):
    spec = write_job_with_files(tmp_path)
    done = fsdpjob("validate", "job.yaml", cwd=tmp_path)
    assert done.returncode == 0 and done.stdout.startswith("job.yaml: ok (profile test-cluster"), done.stderr
    assert fsdpjob("render", str(spec), "--run-dir", str(tmp_path / "run")).returncode == 0


def test_missing_data_file_points_at_data_path(tmp_path):
    write_job_with_files(tmp_path, data=False)
    done = fsdpjob("validate", "job.yaml", cwd=tmp_path)
    assert done.returncode == 2
    assert done.stderr.strip() == f"job.yaml:6: data.path: data file {tmp_path / 'data.jsonl'} does not exist"
    assert fsdpjob("validate", "job.yaml", "--no-file-checks", cwd=tmp_path).returncode == 0


# --- render, schema, profiles, help ------------------------------------------------------------------------------


def spec_name(path: Path) -> str:
    match = re.search(r"^name: (.*)$", path.read_text(), re.MULTILINE)
    assert match, path
    return match.group(1)


@pytest.mark.parametrize("stem", sorted(p.stem for p in VALID.glob("*.yaml")))
def test_render_prints_the_golden_script(stem):
    """The CLI renders exactly what test_render's goldens hold (they use a fixed python path)."""
    name = spec_name(VALID / f"{stem}.yaml")
    done = fsdpjob("render", f"tests/data/specs/valid/{stem}.yaml", "--no-file-checks", "--run-dir", f"/runs/{name}",
                   env=SPEC_VARS)
    assert done.returncode == 0, done.stderr
    golden = (GOLDEN / f"{stem}.sbatch").read_text().replace(GOLDEN_PYTHON, sys.executable)
    assert done.stdout == golden


def test_render_local_profile_explains_there_is_no_script():
    done = fsdpjob("render", SPEC, "--no-file-checks", "--profile", "local", "--set", "resources.tasks_per_node=2",
                   "--run-dir", "/runs/local")  # fmt: skip
    assert done.returncode == 0
    assert done.stdout.startswith("# profile 'local' is local: no sbatch script; 2 worker process(es)")


def test_render_refuses_a_run_dir_with_a_line_break(tmp_path):
    done = fsdpjob("render", SPEC, "--no-file-checks", "--run-dir", str(tmp_path / "a\nb"))
    assert done.returncode == 2 and len(done.stderr.splitlines()) == 1 and "control character" in done.stderr


def test_schema_matches_the_snapshot():
    done = fsdpjob("schema")
    assert done.returncode == 0
    assert json.loads(done.stdout) == json.loads((GOLDEN / "jobspec.schema.json").read_text())


def test_schema_takes_what_validation_takes(tmp_path):
    """An editor's YAML language server checks specs with `fsdpjob schema`: every shipped example and valid spec
    passes it, and so do the values validation accepts that look like another type (time_limit: 90, mem_per_node:
    0); a count given as true fails both."""
    import jsonschema
    import yaml

    schema = json.loads(fsdpjob("schema").stdout)
    checker = jsonschema.Draft202012Validator(schema)
    specs = [*sorted((REPO / "examples").glob("*.yaml")), *sorted(VALID.glob("*.yaml"))]
    for path in specs:
        errors = [e.message for e in checker.iter_errors(yaml.safe_load(path.read_text()))]
        assert not errors, (path.name, errors)
    base = yaml.safe_load((VALID / "single-node.yaml").read_text())
    for resources in ({"time_limit": 90, "mem_per_node": 0}, {"time_limit": "1-00:00", "mem_per_node": "500G"}):
        spec = write_spec_file(tmp_path / "s.yaml", {**base, "resources": resources})
        assert fsdpjob("validate", str(spec), "--no-file-checks").returncode == 0
        assert checker.is_valid(yaml.safe_load(spec.read_text())), resources
    assert not checker.is_valid({**base, "train": {**base["train"], "max_steps": True}})


def test_profiles_table_and_json():
    names = sorted(p.stem for p in (REPO / "cluster_profiles").glob("*.yaml"))
    table = fsdpjob("profiles")
    assert table.returncode == 0
    assert [line.split()[0] for line in table.stdout.splitlines()[1:]] == names
    rows = json.loads(fsdpjob("profiles", "--json").stdout)
    assert [r["name"] for r in rows] == names and {r["scheduler"] for r in rows} == {"slurm", "local"}


def test_help_lists_the_commands():
    done = fsdpjob("--help")
    assert done.returncode == 0
    for command in ("validate", "render", "schema", "profiles", "plan", "submit", "status", "cancel", "logs"):
        assert re.search(rf"^\s+{command}\s", done.stdout, re.MULTILINE), command


def test_unknown_command_is_a_usage_error():
    done = fsdpjob("valiate")
    assert done.returncode == 2 and "No such command 'valiate'" in done.stderr


# --- one verdict: plan, submit --dry-run and submit agree (issue 25) ---------------------------------------------

# The GPU examples: quickstart.yaml and grpo-math.yaml run on the local profile with the quickstart's tiny model.
EXAMPLES = sorted(p.name for p in (REPO / "examples").glob("*.yaml")
                  if p.name not in ("quickstart.yaml", "grpo-math.yaml"))


@pytest.mark.parametrize(
    ("nodes", "sets", "verdict"),
    [(3, [], "FITS"), (2, [], "DOES NOT FIT"),
     (3, ["--set", "fsdp.cpu_offload=true", "--set", "env.FSDPJOB_WEIGHT_LOAD=rank0"], "REFUSED")],
)
def test_plan_dry_run_and_submit_reach_one_verdict(tmp_path, nodes, sets, verdict):
    spec = str(llama2_70b_spec(tmp_path, nodes))
    plan = fsdpjob("plan", spec, *sets, cwd=tmp_path)
    dry = fsdpjob("submit", spec, "--dry-run", *sets, cwd=tmp_path)
    dry_json = fsdpjob("submit", spec, "--dry-run", "--json", *sets, cwd=tmp_path)
    code = 0 if verdict == "FITS" else 2
    assert (plan.returncode, dry.returncode, dry_json.returncode) == (code, code, code), (plan.stderr, dry.stderr)
    assert plan.stdout.rstrip().endswith(f"verdict: {verdict}") and f"verdict: {verdict}" in dry.stderr
    assert json.loads(dry_json.stdout)["plan"]["verdict"] == verdict
    if verdict != "FITS":  # submit refuses with the same words as the dry run, and the fixes
        done = fsdpjob("submit", spec, *sets, cwd=tmp_path)
        assert done.returncode == 2 and done.stderr.splitlines()[-1] == dry.stderr.splitlines()[-1]
        assert ("--set" in done.stderr) if verdict == "DOES NOT FIT" else ("cpu_offload: false" in done.stderr)
    assert "verdict: FITS" not in plan.stdout or verdict == "FITS"


def test_dry_run_json_is_the_request(tmp_path):
    spec = str(llama2_70b_spec(tmp_path, 3))
    done = fsdpjob("submit", spec, "--dry-run", "--json", "--set", "env.HF_TOKEN=hush", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    request = json.loads(done.stdout)
    assert request["script"].startswith("#!/bin/bash") and "#SBATCH --nodes=3" in request["script"]
    assert request["environment"] == ["FSDPJOB_RUN_DIR", "HF_TOKEN"] and "hush" not in done.stdout
    assert request["plan"]["verdict"] == "FITS" and request["scheduler"] == "slurm"


@pytest.mark.parametrize("example", EXAMPLES)
def test_every_shipped_gpu_example_can_be_dry_run(example):
    done = fsdpjob("submit", f"examples/{example}", "--dry-run", "--no-file-checks")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("#!/bin/bash") and "verdict: FITS" in done.stderr


def test_no_file_checks_is_for_the_dry_run_only():
    done = fsdpjob("submit", f"examples/{EXAMPLES[0]}", "--no-file-checks")
    assert done.returncode == 2 and "--no-file-checks goes with --dry-run only" in done.stderr


def test_local_dry_run_shows_the_worker_commands_and_environment(tmp_path):
    spec = write_job_with_files(tmp_path)
    tiny = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "max_position_embeddings": 256,
            "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
            "vocab_size": 256}  # fmt: skip
    (tmp_path / "model" / "config.json").write_text(json.dumps(tiny))
    done = fsdpjob("submit", str(spec), "--dry-run", "--no-file-checks", "--profile", "local", "--set",
                   "resources.tasks_per_node=2", "--set", "env.HF_TOKEN=hush", "--run-dir", "/runs/local")  # fmt: skip
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    supervisor = f"{sys.executable} -m fsdpjob.orchestrator.supervise /runs/local --world-size 2 --scheduler local"
    assert supervisor in lines[2]
    assert lines[4] == f"{sys.executable} -u -m submitit.core._submit /runs/local/submitit"
    for exported in ("export FSDPJOB_RUN_DIR=/runs/local", "export HF_TOKEN=<secret>", "export OMP_NUM_THREADS=1",
                     "export SUBMITIT_LOCAL_NTASKS=2", "export CUDA_VISIBLE_DEVICES=''"):
        assert exported in lines, exported
    assert "hush" not in done.stdout + done.stderr


# --- usage errors exit 2 on every command --------------------------------------------------------------------


def test_every_command_exits_2_on_a_bad_option():
    from fsdpjob.orchestrator.cli import cli

    for name in cli.list_commands(None):  # type: ignore[arg-type]
        done = fsdpjob(name, "--no-such-option")
        assert done.returncode == 2 and "No such option" in done.stderr, (name, done.returncode, done.stderr)


def test_an_existing_run_dir_is_a_usage_error(tmp_path):
    spec = llama2_70b_spec(tmp_path, 3)
    done = fsdpjob("submit", str(spec), "--run-dir", str(tmp_path), cwd=tmp_path)
    assert done.returncode == 2
    assert done.stderr.splitlines()[-1] == f"--run-dir: run folder {tmp_path} already exists; pick another"


def test_a_rank_out_of_range_is_a_usage_error(tmp_path):
    from fsdpjob.orchestrator import registry

    registry.save(registry.JobRecord(run_id="r-1", name="r", run_dir=str(tmp_path), scheduler="local", job_id="1",
                                     profile="local", submitted_at=0.0, spec_hash="x", nodes=1, tasks_per_node=2,
                                     max_steps=1))  # fmt: skip
    done = fsdpjob("logs", "r-1", "--rank", "5")
    assert (done.returncode, done.stderr.strip()) == (2, "--rank: rank 5 is out of range: this run has ranks 0..1")
