"""The linter declared in pyproject.toml ([tool.ruff]) passes on the whole tree, like the layer contracts."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _ruff() -> list[str]:
    exe = Path(sys.executable).with_name("ruff")
    if exe.exists():
        return [str(exe)]
    found = shutil.which("ruff")
    if found is None:
        pytest.fail("ruff is not installed: pip install -e '.[test]'")
    return [found]


def test_ruff_check_passes_on_the_tree():
    done = subprocess.run([*_ruff(), "check", "--no-cache", "."], cwd=REPO, capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr


def test_ruff_reports_a_planted_defect(tmp_path):
    # The check is not vacuous: an unused import in a file under the same settings fails it.
    bad = tmp_path / "bad.py"
    bad.write_text("import os\n", encoding="utf-8")
    done = subprocess.run([*_ruff(), "check", "--no-cache", "--config", str(REPO / "pyproject.toml"), str(bad)],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 1 and "F401" in done.stdout, done.stdout + done.stderr


# The project's own bash scripts (CI, the dev cluster, the benches): the rendered ones are checked in test_render.py.
SHELL_SCRIPTS = (".ci/run", ".ci/vllm-env", "bench/chaos.sh", "bench/elastic_trial/job.sh", "bench/gpu",
                 "orchestrator/devcluster/cluster.sh")


def test_shellcheck_passes_on_the_projects_own_scripts():
    shellcheck = shutil.which("shellcheck")
    if shellcheck is None:
        pytest.skip("shellcheck is not installed (conftest.py installs it as root)")
    done = subprocess.run([shellcheck, *SHELL_SCRIPTS], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
