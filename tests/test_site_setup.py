"""Site set-up that fails at validate time, not on the node (issue 23, part 6): setup lines are simple commands
(an operator is refused, naming the line), and a $VAR that the batch script (set -u) would find unbound after
the queue wait is refused with the fix, while ${VAR:-default} works."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml
from helpers import fsdpjob

from fsdpjob.orchestrator.core import envrefs
from fsdpjob.orchestrator.core.jobspec.profiles import shell_operator
from fsdpjob.orchestrator.slurm.shellquote import with_vars


@pytest.mark.parametrize("line, operator", [
    ("module load cuda/12.4", None), ("conda activate train", None), ("source $HOME/venv/bin/activate", None),
    ('echo "a && b; c"', None), ("module load cuda && module load nccl", "&&"), ("cd /x; ls", ";"),
    ("module list 2>&1 | tee log", ">&"), ("ml x > log", ">"), ("export A=$(hostname)", "$("), ("x `id`", "`"),
])
def test_setup_operators_are_found_outside_quotes(line, operator):
    assert shell_operator(line) == operator


def write(tmp_path: Path, profile: dict, spec_extra: dict | None = None) -> Path:
    (tmp_path / "site.yaml").write_text(yaml.safe_dump({"scheduler": "slurm", "partition": "p", **profile}))
    spec = {"name": "s", "profile": str(tmp_path / "site.yaml"), "model": {"path": str(tmp_path / "m")},
            "data": {"path": str(tmp_path / "d.jsonl")}, "train": {"max_steps": 5}, **(spec_extra or {})}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    return tmp_path / "job.yaml"


def test_a_setup_line_with_an_operator_is_refused_naming_it(tmp_path):
    spec = write(tmp_path, {"setup": ["module load cuda/12.4", "module load nccl && echo ok"]})
    done = fsdpjob("validate", str(spec), "--no-file-checks")
    assert done.returncode == 2 and "site.yaml" in done.stderr and "setup line 2" in done.stderr, done.stderr
    assert "'&&'" in done.stderr and "its own line" in done.stderr and "Traceback" not in done.stderr


def test_module_load_and_conda_activate_lines_run_in_the_batch_script(tmp_path, monkeypatch):
    # The rendered script with stub `module` and `conda` functions sourced first: both lines run, in order.
    spec = write(tmp_path, {"setup": ["module load cuda/12.4", "conda activate train"]})
    run_dir = tmp_path / "run"
    script = fsdpjob("render", str(spec), "--no-file-checks", "--run-dir", str(run_dir), check=True).stdout
    setup = script[script.index("# Profile setup"):script.index("export ")]
    stubs = 'module() { echo "module $*"; }\nconda() { echo "conda $*"; }\n'
    done = subprocess.run(["bash", "-c", "set -euo pipefail\n" + stubs + setup], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.splitlines() == ["module load cuda/12.4", "conda activate train"], done


def test_a_variable_unset_at_submit_time_is_refused_with_the_fix(tmp_path, monkeypatch):
    monkeypatch.delenv("FSDPJOB_TEST_UNSET", raising=False)
    monkeypatch.setenv("FSDPJOB_TEST_SET", "x")
    spec = write(tmp_path, {"env": {"P": "$FSDPJOB_TEST_UNSET/p"}}, {"env": {"A": "${FSDPJOB_TEST_UNSET}/a"}})
    done = fsdpjob("validate", str(spec))
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert any(line.startswith(f"{spec}:") and "env.A" in line and "${FSDPJOB_TEST_UNSET:-}" in line for line in lines)
    assert any("profile" in line and "env.P" in line for line in lines), lines
    # Set where one submits, given a default, or set on the node by Slurm or fsdpjob: all fine.
    ok = write(tmp_path, {"env": {"P": "${FSDPJOB_TEST_UNSET:-/tmp}"}},
               {"env": {"A": "$FSDPJOB_TEST_SET/$SLURM_JOB_ID", "B": "$FSDPJOB_RUN_DIR/x"}})
    done = fsdpjob("validate", str(ok))
    assert "not set where you submit" not in done.stderr, done.stderr


def test_defaults_expand_and_everything_else_stays_literal():
    assert envrefs.required("${A:-x}/$B/${C}/~") == ["B", "C"]
    assert envrefs.required("~/x") == ["HOME"]
    word = with_vars("${SCRATCH:-/tmp}/$(id)")
    done = subprocess.run(["bash", "-c", f"set -u; unset SCRATCH; printf %s {word}"], capture_output=True, text=True)
    assert done.stdout == "/tmp/$(id)", done
