"""Shared fixtures: tiny spec files, hostile strings, an isolated FSDPJOB_HOME."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
sys.path.insert(0, str(TESTS))  # for `from distributed import run_ranks`


# What some tests need from Debian packages: sbatch (hostile-input and fuzz tests), shellcheck (rendered
# scripts), the Slurm daemons (tests/slurm).
NEEDED_TOOLS = ("sbatch", "shellcheck", "slurmctld", "slurmd", "munge", "slurmdbd")


def pytest_configure(config: pytest.Config) -> None:
    """The README's test command on a fresh machine runs every test: as root where apt-get exists, the Debian
    packages some tests need are installed before collection (their modules look for the tools when they
    load), instead of those tests skipping. FSDPJOB_NO_INSTALL=1 turns this off."""
    missing = [tool for tool in NEEDED_TOOLS if shutil.which(tool) is None]
    if not missing or os.environ.get("FSDPJOB_NO_INSTALL") == "1" or os.geteuid() != 0 or not shutil.which("apt-get"):
        return
    from fsdpjob.orchestrator.core.errors import FsdpjobError
    from fsdpjob.orchestrator.devcluster import manage

    print(f"fsdpjob tests: installing the Debian packages for {', '.join(missing)}", file=sys.stderr)
    try:
        manage.ensure_packages(echo=True)
    except FsdpjobError as exc:  # the tests that need them skip (or fail under FSDPJOB_REQUIRE_SLURM=1)
        print(f"fsdpjob tests: could not install them: {exc}", file=sys.stderr)


@pytest.fixture(autouse=True)
def _isolated_home(tmp_path_factory, monkeypatch):
    """Every test gets its own registry so tests never see the user's jobs or each other's."""
    home = tmp_path_factory.mktemp("fsdpjob_home")
    monkeypatch.setenv("FSDPJOB_HOME", str(home))
    monkeypatch.delenv("FSDPJOB_PROFILES", raising=False)
    return home


@pytest.fixture(autouse=True)
def _no_cluster_unless_asked(request, monkeypatch):
    """A test that asks for no dev cluster reaches none: the cluster tests' session fixtures (tests/slurm, e.g. the
    reference run) export SLURM_CONF for the rest of the session, and with it `validate` would count the dev
    cluster's partition through sinfo and `plan` ask its sbatch --test-only (seen in CI: an invalid spec got a
    second refusal, nodes over the partition's 2). The cluster fixtures set SLURM_CONF again for their tests."""
    if "slurm" not in request.keywords and not any(name.startswith("slurm_cluster") for name in request.fixturenames):
        monkeypatch.delenv("SLURM_CONF", raising=False)
