"""Fixtures for tests on the real local Slurm dev cluster: bring-up, sharing, teardown (plain helpers are in
slurm_helpers.py).

Two clusters may run side by side: `slurm_cluster` (with slurmdbd, so sacct works) and
`slurm_cluster_noacct` (no accounting, like many real clusters). They live in
$FSDPJOB_DEVCLUSTER_DIR (default /tmp/fsdpjob-devcluster) and the same path + "-noacct", on port
bases $FSDPJOB_DEVCLUSTER_PORT_BASE (default 16810) and that + 20. A third, `slurm_cluster4` (4 nodes, no
accounting, partition `wide` on n[1-4]: spare nodes for a requeue that excludes one), lives in the path +
"-4n" on the port base + 40 and comes up only when a test that needs it runs. Test sessions running at the same
time share them; the last session out stops a cluster that a test session started
(FSDPJOB_KEEP_CLUSTER=1 keeps it). When a cluster cannot be had, its tests skip, or fail where
FSDPJOB_REQUIRE_SLURM=1 (CI).
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NoReturn

import pytest
from helpers import wait_for
from slurm.slurm_helpers import final_weights, submit, wait_phase
from specs import build, quickstart_spec, write_spec

from fsdpjob.orchestrator.core.errors import FsdpjobError
from fsdpjob.orchestrator.devcluster import manage
from fsdpjob.orchestrator.devcluster.manage import ClusterInfo

HERE = Path(__file__).resolve().parent
STATE_DIR = os.environ.get("FSDPJOB_DEVCLUSTER_DIR", "/tmp/fsdpjob-devcluster")
PORT_BASE = int(os.environ.get("FSDPJOB_DEVCLUSTER_PORT_BASE", "16810"))
USERS = "test-sessions"  # per-state-dir folder of live test sessions, one file per pytest PID
STARTED_BY_TESTS = "started-by-tests"  # marker: a test session started it, so the last one out stops it


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in item.path.parents:
            item.add_marker(pytest.mark.slurm)


def _unavailable(reason: str) -> NoReturn:
    if os.environ.get("FSDPJOB_REQUIRE_SLURM") == "1":
        pytest.fail(f"FSDPJOB_REQUIRE_SLURM=1 but the dev cluster is unavailable: {reason}", pytrace=False)
    pytest.skip(f"dev cluster unavailable: {reason.splitlines()[0]}")


def _live_users(state_dir: Path) -> list[Path]:
    users = state_dir / USERS
    live = []
    for entry in users.glob("*") if users.is_dir() else []:
        if entry.name.isdigit() and Path(f"/proc/{entry.name}").exists():
            live.append(entry)
        else:
            entry.unlink(missing_ok=True)  # a session that died without teardown
    return live


def _stop_quietly(state_dir: str) -> None:
    """Stop what a failed `up` started; its logs stay in the state dir."""
    try:
        manage.down(state_dir=state_dir)
    except FsdpjobError:
        pass


def _cluster(accounting: bool, state_dir: str, port_base: int, containers: bool = False,
             nodes: int | None = None) -> Iterator[ClusterInfo]:
    if os.geteuid() != 0:
        _unavailable("needs root (the daemons run with SlurmUser=root)")
    info, failure, was_up = None, "", True
    try:
        was_up = manage.status(state_dir).startswith("cluster: up")
        info = manage.up(accounting=accounting, state_dir=state_dir, port_base=port_base, nodes=nodes,
                         containers=containers)
    except FsdpjobError as error:
        failure = str(error)
    if info is None:  # reported outside the except block, so pytest shows no chained traceback
        if not was_up:
            _stop_quietly(state_dir)
        _unavailable(failure)
    me = info.state_dir / USERS / str(os.getpid())
    me.parent.mkdir(exist_ok=True)
    me.touch()
    if not was_up:
        (info.state_dir / STARTED_BY_TESTS).touch()
    yield info
    me.unlink(missing_ok=True)
    if os.environ.get("FSDPJOB_KEEP_CLUSTER") == "1" or _live_users(info.state_dir):
        return
    if (info.state_dir / STARTED_BY_TESTS).exists():
        manage.down(state_dir=state_dir, purge=True)


@pytest.fixture(scope="session")
def slurm_cluster_session() -> Iterator[ClusterInfo]:
    """The accounting cluster for the whole session; does not touch SLURM_CONF (see slurm_env)."""
    yield from _cluster(True, STATE_DIR, PORT_BASE, containers=True)


@pytest.fixture(scope="session")
def slurm_cluster_noacct_session() -> Iterator[ClusterInfo]:
    """The cluster without accounting for the whole session; does not touch SLURM_CONF (see slurm_env)."""
    yield from _cluster(False, f"{STATE_DIR}-noacct", PORT_BASE + 20)


@pytest.fixture(scope="session")
def slurm_cluster4_session() -> Iterator[ClusterInfo]:
    """The 4-node cluster for the whole session (no accounting: lighter; nothing these tests check needs sacct)."""
    yield from _cluster(False, f"{STATE_DIR}-4n", PORT_BASE + 40, nodes=4)


# SLURM_CONF is set per test, not per session: tests of the clusters interleave in one session.
def _for_this_test(info: ClusterInfo, monkeypatch: pytest.MonkeyPatch,
                   tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClusterInfo]:
    monkeypatch.setenv("SLURM_CONF", str(info.slurm_conf))
    yield info
    _cancel_leftovers(tmp_path_factory.getbasetemp())


@pytest.fixture
def slurm_cluster(
    slurm_cluster_session: ClusterInfo, monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ClusterInfo]:
    """The cluster with slurmdbd (sacct works); SLURM_CONF points at it for this test."""
    yield from _for_this_test(slurm_cluster_session, monkeypatch, tmp_path_factory)


@pytest.fixture
def slurm_cluster_noacct(
    slurm_cluster_noacct_session: ClusterInfo, monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ClusterInfo]:
    """The cluster without accounting; SLURM_CONF points at it for this test."""
    yield from _for_this_test(slurm_cluster_noacct_session, monkeypatch, tmp_path_factory)


@pytest.fixture
def slurm_cluster4(
    slurm_cluster4_session: ClusterInfo, monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ClusterInfo]:
    """The 4-node cluster (partition `wide` on n[1-4]); SLURM_CONF points at it for this test."""
    yield from _for_this_test(slurm_cluster4_session, monkeypatch, tmp_path_factory)


def _cancel_leftovers(basetemp: Path) -> None:
    """Cancel this session's jobs that a test left behind (a failed test must not hold the nodes for
    the next ones). This session's jobs write their output under its pytest folder; jobs of another
    test session sharing the cluster do not, and are left alone."""
    from fsdpjob.orchestrator.slurm import commands as slurm_cli

    mine = []
    for job_id in slurm_cli.squeue():
        info = slurm_cli.scontrol_job(job_id) or {}
        active = info.get("JobState") in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "REQUEUED", "SUSPENDED")
        if active and info.get("StdOut", "").startswith(str(basetemp)):
            mine.append(job_id)
    for job_id in mine:
        try:
            slurm_cli.scancel(job_id)
        except slurm_cli.SlurmCommandError:
            pass  # it ended meanwhile
    if mine:
        wait_for(lambda: not set(mine) & {j for j, v in slurm_cli.squeue(mine).items()
                                          if v["state"] in ("PENDING", "RUNNING", "COMPLETING", "CONFIGURING")},
                 timeout_s=60, interval_s=0.5, what=f"left-over jobs {mine} to end")


@pytest.fixture(scope="session")
def assets(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A tiny Llama model, tokenizer and JSONL data set, built once per session."""
    from fsdpjob.jobs.quickstart import make_quickstart

    return make_quickstart(tmp_path_factory.mktemp("assets"))


@pytest.fixture(scope="session")
def make_spec(assets: dict, tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """make(name, section__field=value, ...) writes a 2-node x 1-task spec YAML and returns its path. One rank a
    node: what the scenarios assert (a stop, a requeue, a fault on one node, the bits) needs two nodes, not two
    ranks on each, and every rank launch costs ~10 CPU-s on the shared 2 cores; the tests that tell a rank from
    its peer on the same node (and GRPO's, whose ranks share the first node) ask for resources__gpus_per_node=2."""
    tmp_path = tmp_path_factory.mktemp("specs")

    def make(name: str, **overrides) -> Path:
        base = quickstart_spec(
            assets,
            name=name,
            profile="test-cluster",
            resources={"nodes": 2, "gpus_per_node": 1, "time_limit": "10:00"},
            train={"max_steps": 60, "micro_batch_size": 2, "lr": 3e-3, "warmup_steps": 5, "log_every": 2},
            fsdp={"mixed_precision": "fp32"},
            checkpoint={"interval_steps": 0, "interval_minutes": 0},
        )
        return write_spec(tmp_path / f"{name}.yaml", build(base, **overrides))

    return make


def _reference(cluster: ClusterInfo, make_spec, tmp_path_factory, name: str, **overrides) -> dict:
    os.environ["SLURM_CONF"] = str(cluster.slurm_conf)
    os.environ["FSDPJOB_HOME"] = str(tmp_path_factory.mktemp(f"{name}_home"))
    spec = make_spec(name, train__max_steps=60, **overrides)
    ref = submit(spec)
    assert wait_phase(ref["run_id"], {"COMPLETED", "FAILED"}, timeout=300)["phase"] == "COMPLETED"
    return {"spec": spec, "weights": final_weights(ref["run_dir"]), "run_dir": ref["run_dir"]}


@pytest.fixture(scope="session")
def reference(slurm_cluster_session, make_spec, tmp_path_factory) -> dict:
    """An uninterrupted 2x1 run of the spec the interrupted runs use (their final weights must match it)."""
    return _reference(slurm_cluster_session, make_spec, tmp_path_factory, "uninterrupted")


@pytest.fixture(scope="session")
def reference_2x2(slurm_cluster_session, make_spec, tmp_path_factory) -> dict:
    """The same at 2 nodes x 2 tasks, for the tests whose faults must be told from a peer on the same node."""
    return _reference(slurm_cluster_session, make_spec, tmp_path_factory, "uninterrupted-2x2",
                      resources__gpus_per_node=2)





@pytest.fixture
def in_container(slurm_cluster: ClusterInfo, tmp_path_factory, monkeypatch) -> tuple[str, ...]:
    """`fsdpjob submit` options that run the workers in the dev cluster's test image (issue 23), bubblewrap in each
    task; the image holds Python, torch and fsdpjob, no Slurm binary and no munge.

    FSDPJOB_TEST_CONTAINER_RUNTIME=pyxis runs the same tests under pyxis + enroot instead, where they were built
    from source and set up by hand (no Debian package; CI cannot fetch them: bench/RESULTS.md says how): pyxis in
    the dev cluster's plugstack.conf and an enroot container named pyxis_fsdpjob-test holding the test image."""
    assert slurm_cluster.image is not None
    if os.environ.get("FSDPJOB_TEST_CONTAINER_RUNTIME", "bubblewrap") == "pyxis":
        listed = subprocess.run(["enroot", "list"], capture_output=True, text=True).stdout.split()
        assert "pyxis_fsdpjob-test" in listed, "no enroot container pyxis_fsdpjob-test (see bench/RESULTS.md)"
        profiles = tmp_path_factory.mktemp("profiles")
        text = (Path(__file__).parents[2] / "cluster_profiles" / "test-cluster-container.yaml").read_text()
        text = text.replace("container_runtimes: [bubblewrap]", "container_runtimes: [pyxis]")
        text = text.replace("  runtime: bubblewrap\n", "  runtime: pyxis\n  name: fsdpjob-test\n")
        text = "\n".join(line for line in text.splitlines() if not line.startswith("  image:"))
        (profiles / "test-cluster-pyxis.yaml").write_text(text + "\n")
        monkeypatch.setenv("FSDPJOB_PROFILES", str(profiles))
        return ("--set", "profile=test-cluster-pyxis")
    return ("--set", "profile=test-cluster-container", "--set", f"container.image={slurm_cluster.image}")
