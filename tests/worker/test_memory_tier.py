"""The memory checkpoint tier end to end (jobs.train.run on real gloo ranks, two emulated nodes n1 and n2): every
rank crashes at once after step 7 with no durable checkpoint; the restart resumes from the tier's newest complete
step and ends with the uninterrupted run's bits. With node n2's folder gone, one rank on n1 resumes from its own
shard and n2's replica, resharded; a tier of another job, or one missing a part, is never chosen."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from distributed import committed_model_state, exit_codes, logged_losses, node_worker, run_ranks
from test_resume import make_run

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

STEPS, EVERY, CRASH = 10, 2, 7
NODES = ["n1", "n2"]


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> dict:
    from fsdpjob.jobs.quickstart import make_quickstart

    return make_quickstart(tmp_path_factory.mktemp("assets"))


def _run(root: Path, name: str, assets: dict) -> Path:
    run_dir = make_run(root, name, assets)
    spec = json.loads((run_dir / "spec.json").read_text())
    spec["spec"]["checkpoint"]["memory_interval_steps"] = EVERY
    (run_dir / "spec.json").write_text(json.dumps(spec))
    return run_dir


def _events(run_dir: Path, kind: str) -> list[dict]:
    return [e for e in map(json.loads, (run_dir / "events.jsonl").read_text().splitlines()) if e["event"] == kind]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, assets) -> dict:
    root = tmp_path_factory.mktemp("runs")
    shm = root / "shm"
    env = {"FSDPJOB_MEMORY_TIER_DIR": str(shm)}
    full = _run(root, "full", assets)
    assert run_ranks(node_worker, 2, run_dir=str(full), env=env, nodes=NODES) == [0, 0]
    crashed = _run(root, "crashed", assets)
    codes = exit_codes(node_worker, 2, run_dir=str(crashed), env={**env, "FSDPJOB_FAULT_EXIT_STEP": str(CRASH)},
                       nodes=NODES)
    assert codes == [70, 70], codes
    assert not (crashed / "checkpoints" / "latest").exists()  # nothing durable: only the tier can resume it
    [job] = [p for p in shm.iterdir()]
    saved = {"tier": root / "tier-copy", "run": root / "crashed-copy"}
    shutil.copytree(job, saved["tier"], symlinks=True)
    shutil.copytree(crashed, saved["run"])
    assert run_ranks(node_worker, 2, run_dir=str(crashed), env=env, nodes=NODES) == [0, 0]
    after_same = {"events": _events(crashed, "resume"), "weights": committed_model_state(crashed),
                  "losses": logged_losses(crashed), "tier_left": job.exists()}
    # The lost node: n2's folder gone; one rank on n1 reads its own shard and n2's replica.
    shutil.rmtree(crashed)
    saved["run"].rename(crashed)
    shutil.copytree(saved["tier"], job, symlinks=True)
    shutil.rmtree(job / "n2")
    assert run_ranks(node_worker, 1, run_dir=str(crashed), env=env, nodes=["n1"]) == [0]
    return {"full": full, "same": after_same, "on1": {"events": _events(crashed, "resume"),
                                                       "losses": logged_losses(crashed)},
            "tier": saved["tier"], "shm": shm, "job": job.name}


def test_crash_resumes_from_the_memory_tier_bitwise(runs):
    [resume] = runs["same"]["events"]
    assert resume["tier"] == "memory" and resume["step"] in (CRASH - 1, CRASH - 1 - EVERY), resume
    a, b = committed_model_state(runs["full"]), runs["same"]["weights"]
    assert all((a[k] == b[k]).all() for k in a)
    full = logged_losses(runs["full"])
    assert all(runs["same"]["losses"][s] == full[s] for s in range(resume["step"] + 1, STEPS + 1))
    assert not runs["same"]["tier_left"]  # the completed job removed its tier


def test_lost_node_reshards_from_the_replica(runs):
    [resume] = runs["on1"]["events"]
    assert resume["tier"] == "memory" and resume["world_size"] == 1 and resume["grad_accum_steps"] == 6, resume
    full, other = logged_losses(runs["full"]), runs["on1"]["losses"]
    for step in range(resume["step"] + 1, STEPS + 1):  # reduction order differs: close, not bitwise
        assert abs(other[step] - full[step]) <= 1e-5 * abs(full[step]), (step, other[step], full[step])
