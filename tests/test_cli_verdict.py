"""One verdict with every flag (issue 38 A): validate, validate --no-file-checks, plan, render, submit --dry-run,
submit and sweep --dry-run refuse the same specs with the same first line and exit 2; --no-file-checks skips the
file system's checks only, never the environment's. The CLI runs in this process (helpers.run_cli)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from helpers import run_cli

REPO = Path(__file__).resolve().parents[1]
INVALID = REPO / "tests" / "data" / "specs" / "invalid"
SPEC = "tests/data/specs/valid/single-node.yaml"
GPU_EXAMPLE = "examples/qwen2.5-7b-h200.yaml"
# An expected error about the model folder or the data (what --no-file-checks may skip).
FILE_CHECK = re.compile(r"^\d+: (model\.path|data\.\w+|checkpoint\.dir): ")


@pytest.fixture(autouse=True)
def _in_the_repo(monkeypatch, tmp_path):
    monkeypatch.chdir(REPO)  # the specs are named relative to the repository, as test_cli's
    monkeypatch.setenv("FSDPJOB_HOME", str(tmp_path / "home"))  # a submit that got through would write here
    monkeypatch.delenv("NO_SUCH_VAR_38", raising=False)
    monkeypatch.delenv("NO_SUCH_HOOK_38", raising=False)


def first_line(text: str) -> str:
    return text.splitlines()[0] if text else ""


@pytest.mark.parametrize(
    "sets, said",
    [(["env.GREETING=$NO_SUCH_VAR_38"], "env.GREETING: $NO_SUCH_VAR_38 is not set where you submit"),
     (["notify.webhook_url_env=NO_SUCH_HOOK_38"], "notify.webhook_url_env: $NO_SUCH_HOOK_38 (the webhook URL) is not "
                                                   "set where you submit")],
)
def test_no_file_checks_still_checks_the_environment(sets, said):
    """An unset $VAR kills the job on the node whatever the files: every command refuses it, with or without
    --no-file-checks, render included."""
    sets = [a for s in sets for a in ("--set", s)]
    runs = {
        "submit": run_cli("submit", SPEC, *sets),
        "validate": run_cli("validate", SPEC, *sets),
        "validate --no-file-checks": run_cli("validate", SPEC, "--no-file-checks", *sets),
        "plan": run_cli("plan", SPEC, *sets),
        "render --no-file-checks": run_cli("render", SPEC, "--no-file-checks", *sets),
        "submit --dry-run --no-file-checks": run_cli("submit", SPEC, "--dry-run", "--no-file-checks", *sets),
        "sweep --dry-run --no-file-checks": run_cli("sweep", SPEC, "--grid", "train.lr=1e-4,2e-4", "--dry-run",
                                                    "--no-file-checks", *sets),
    }
    for how, (code, _out, err) in runs.items():
        assert code == 2 and said in first_line(err), (how, code, err)
    lines = {how: first_line(err) for how, (_, _, err) in runs.items() if not how.startswith("sweep")}
    assert len(set(lines.values())) == 1, lines  # the sweep's line names its variant first


def test_a_sweep_of_a_gpu_example_can_be_dry_run_before_the_weights_exist():
    code, out, err = run_cli("sweep", GPU_EXAMPLE, "--grid", "train.lr=1e-5,2e-5", "--dry-run", "--no-file-checks")
    assert code == 0, err
    assert out.startswith("#!/bin/bash") and "variant 1:" in err
    code, _, err = run_cli("sweep", GPU_EXAMPLE, "--grid", "train.lr=1e-5,2e-5", "--dry-run")
    assert code == 2 and "no weights in" in err  # without the flag, the missing weights are found
    lines = err.splitlines()  # each problem on its own line, as validate prints them
    assert len(lines) > 1 and all(line.startswith("sweep variant 0 of 2 (train.lr=1e-5): examples/") for line in lines)
    code, _, err = run_cli("sweep", GPU_EXAMPLE, "--grid", "train.lr=1e-5,2e-5", "--no-file-checks")
    assert code == 2 and "--no-file-checks goes with --dry-run only" in err


def corpus() -> list:
    return [pytest.param(p, id=p.stem) for p in sorted(INVALID.glob("*.yaml"))]


@pytest.mark.parametrize("path", corpus())
def test_every_invalid_spec_gets_one_verdict_from_every_command(path):
    """The whole invalid corpus: validate, plan, submit --dry-run and submit (which fails before any scheduler
    call: the spec is refused first) exit 2 with the same first line; validate --no-file-checks too where the
    expected error is not a file check."""
    rel = path.relative_to(REPO).as_posix()
    expects = re.findall(r"^# expect: (.*)$", path.read_text(), re.MULTILINE)
    commands = [("validate", rel), ("plan", rel), ("submit", rel, "--dry-run"), ("submit", rel)]
    if not FILE_CHECK.match(expects[0]):
        commands.append(("validate", rel, "--no-file-checks"))
    verdicts = {" ".join(args): run_cli(*args) for args in commands}
    for how, (code, _out, err) in verdicts.items():
        assert code == 2, (how, code, err)
    firsts = {how: first_line(err) for how, (_, _, err) in verdicts.items()}
    assert len(set(firsts.values())) == 1, firsts
    assert next(iter(firsts.values())).startswith(f"{rel}:{expects[0].partition(':')[0]}: "), firsts
