"""Shared fixtures: tiny spec files, hostile strings, an isolated FSDPJOB_HOME."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
sys.path.insert(0, str(TESTS))  # for `from distributed import run_ranks`


# What some tests need from Debian packages: sbatch (hostile-input and fuzz tests), shellcheck (rendered
# scripts), the Slurm daemons (tests/slurm), bubblewrap and mmdebstrap (the test image); the dev cluster's script
# installs them. The browser is the tests' alone (report --html in a headless chromium): installed here.
NEEDED_TOOLS = ("sbatch", "shellcheck", "slurmctld", "slurmd", "munge", "slurmdbd", "bwrap", "mmdebstrap")
TEST_ONLY_PACKAGES = {"chromium": "chromium"}  # tool: Debian package


def pytest_configure(config: pytest.Config) -> None:
    """The README's test command on a fresh machine runs every test: as root where apt-get exists, the Debian
    packages some tests need are installed before collection (their modules look for the tools when they
    load), instead of those tests skipping. FSDPJOB_NO_INSTALL=1 turns this off. FSDPJOB_TEST_CPU_LOG=FILE
    logs each test's CPU seconds (tests/cpuprofile.py)."""
    import cpuprofile  # tests/ is on sys.path (above)

    cpuprofile.register(config)
    missing = [tool for tool in NEEDED_TOOLS if shutil.which(tool) is None]
    if hasattr(config, "workerinput"):  # an xdist worker: the controller installed them before it started
        return
    if os.environ.get("FSDPJOB_NO_INSTALL") == "1" or os.geteuid() != 0 or not shutil.which("apt-get"):
        return
    _install_test_only_packages()
    if not missing:
        return
    from fsdpjob.orchestrator.core.errors import FsdpjobError
    from fsdpjob.orchestrator.devcluster import manage

    print(f"fsdpjob tests: installing the Debian packages for {', '.join(missing)}", file=sys.stderr)
    try:
        manage.ensure_packages(echo=True)
    except FsdpjobError as exc:  # the tests that need them skip (or fail under FSDPJOB_REQUIRE_SLURM=1)
        print(f"fsdpjob tests: could not install them: {exc}", file=sys.stderr)


def _install_test_only_packages() -> None:
    packages = [package for tool, package in TEST_ONLY_PACKAGES.items() if shutil.which(tool) is None]
    if not packages:
        return
    print(f"fsdpjob tests: installing the Debian packages {', '.join(packages)}", file=sys.stderr)
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for command in (["apt-get", "update", "-q"], ["apt-get", "install", "-y", "-q", "--no-install-recommends",
                                                   *packages]):
        done = subprocess.run(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if done.returncode != 0:  # the browser test skips (or fails under FSDPJOB_REQUIRE_BROWSER=1)
            print(f"fsdpjob tests: {' '.join(command[:2])} failed: {done.stderr.strip()[-300:]}", file=sys.stderr)
            return


# The suite runs on two xdist workers (pyproject's addopts: -n 2 --dist loadgroup). The tests of one dev cluster
# are one group, so they run one after another on one worker (the cluster has two nodes: two 2-node jobs at once
# would queue behind each other and outlast their tests' waits); the groups come first, so one worker starts on
# the main cluster's tests (mostly waiting on Slurm: holds, grace periods, polling) while the other takes
# everything else a test at a time. The slow ungrouped tests go first so the two end together; within a queue, the
# tests on vLLM go after the other slow ones (its environment may still be building: .ci/run).
CLUSTER_GROUPS = (("slurm_cluster_session", "cluster"), ("slurm_cluster_noacct_session", "cluster-noacct"),
                  ("slurm_cluster4_session", "cluster4"))


def cluster_group(fixturenames: list[str]) -> str | None:
    return next((group for fixture, group in CLUSTER_GROUPS if fixture in fixturenames), None)


def pytest_itemcollected(item: pytest.Item) -> None:
    """Marked as each test is collected: before any plugin's collection_modifyitems (xdist's reads the mark)."""
    group = cluster_group(getattr(item, "fixturenames", []))
    if group:
        item.add_marker(pytest.mark.xdist_group(group))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    order = {group: i for i, (_, group) in enumerate(CLUSTER_GROUPS)}

    def rank(item: pytest.Item) -> tuple[int, int, int]:
        group = cluster_group(getattr(item, "fixturenames", []))
        slow = item.get_closest_marker("slow") is not None
        # The tests on vLLM come after the other slow ones of their queue: .ci/run builds vLLM's environment while
        # the first tests run (tests/vllmenv.py waits for it).
        on_vllm = hasattr(getattr(item, "module", None), "vllm_python")
        return order.get(group, len(order)), 0 if slow else 1, 1 if on_vllm else 0

    items.sort(key=rank)


@pytest.hookimpl(trylast=True)
def pytest_collection_finish(session: pytest.Session) -> None:
    """On an xdist worker, the groups must have reached the node ids (xdist's mark of a group); a pytest that
    xdist does not know how to rename (pytest 9.2 and xdist 3.8) would silently spread one cluster's tests over
    both workers, which then queue behind each other's jobs and fail their waits."""
    config = session.config
    if not hasattr(config, "workerinput") or not config.getvalue("loadgroup"):
        return
    lost = [item.nodeid for item in session.items if item.get_closest_marker("xdist_group") and "@" not in item.nodeid]
    if lost:
        raise pytest.UsageError(f"pytest-xdist did not group the cluster tests ({lost[0]}): install the test extra's "
                                "pytest (pyproject.toml), or run with -n 0")


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
