"""The layer rules of pyproject.toml ([tool.importlinter]) hold: lint-imports, the well-kept checker, runs here."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def lint_imports() -> subprocess.CompletedProcess:
    exe = shutil.which("lint-imports") or str(Path(sys.executable).with_name("lint-imports"))
    return subprocess.run([exe, "--no-cache"], cwd=REPO, capture_output=True, text=True, timeout=120)


def test_every_layer_contract_is_kept():
    done = lint_imports()
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Contracts: 5 kept, 0 broken." in done.stdout


# lint-imports with the copy first on the import path (ahead of the editable install's finder).
PROBE = """
import sys
sys.path.insert(0, sys.argv.pop(1))
import fsdpjob.orchestrator
assert fsdpjob.orchestrator.__file__.startswith(sys.path[0]), fsdpjob.orchestrator.__file__
from importlinter.cli import lint_imports_command
lint_imports_command()
"""


def test_a_forbidden_import_breaks_its_contract(tmp_path):
    """The contracts can fail: a copy of the tree with a subprocess import in the planner is refused."""
    copy = tmp_path / "repo"
    shutil.copytree(REPO, copy, ignore=shutil.ignore_patterns(".git", ".venv", "runs", "*.egg-info", "__pycache__",
                                                              "quickstart-assets", ".pytest_cache", ".hypothesis"))
    fit = copy / "orchestrator" / "planner" / "fit.py"
    fit.write_text(fit.read_text() + "\nimport subprocess  # forbidden here\n")
    # Point the import path at the copy: its orchestrator/ and jobs/ folders become fsdpjob.orchestrator/jobs.
    pkg = tmp_path / "site" / "fsdpjob"
    pkg.mkdir(parents=True)
    (pkg / "orchestrator").symlink_to(copy / "orchestrator")
    (pkg / "jobs").symlink_to(copy / "jobs")
    done = subprocess.run(
        [sys.executable, "-c", PROBE, str(tmp_path / "site"), "--no-cache"], cwd=copy, capture_output=True, text=True,
        timeout=120,
    )
    assert done.returncode != 0, done.stdout + done.stderr
    assert "Planning and rendering are pure: no subprocess, no submitit BROKEN" in done.stdout
    assert "fsdpjob.orchestrator.planner.fit -> subprocess" in done.stdout
