"""The memory checkpoint tier end to end (jobs.train.run on real gloo ranks, two emulated nodes n1 and n2): every
rank crashes at once after step 7 with no durable checkpoint; the restart resumes from the tier's newest complete
step and ends with the uninterrupted run's bits. With node n2's folder gone, one rank on n1 resumes from its own
shard and n2's replica, resharded; a tier of another job, or one missing a part, is never chosen."""

from __future__ import annotations

import json
import shutil
import subprocess
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
    saved = {"tier": root / "tier-copy", "run": root / "crashed-copy", "run_again": root / "crashed-copy-2"}
    shutil.copytree(job, saved["tier"], symlinks=True)
    shutil.copytree(crashed, saved["run"])
    shutil.copytree(crashed, saved["run_again"])
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
            "tier": saved["tier"], "shm": shm, "job": job.name, "crashed": crashed, "crashed_copy": saved["run_again"]}


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


def test_a_corrupted_snapshot_file_is_never_loaded_and_its_replica_resumes_the_run_bitwise(runs):
    """A flipped byte in n2's own shard of the tier's newest step (its size unchanged): its checksum fails at the
    resume's scan, the file is passed over (said in the resume event), and rank 1 reads its shard from the replica on
    n1 instead; the run ends with the uninterrupted run's bits. Same run folder as the crash (the tier's key)."""
    crashed, job = runs["crashed"], runs["shm"] / runs["job"]
    shutil.rmtree(crashed)
    shutil.copytree(runs["crashed_copy"], crashed)
    shutil.rmtree(job, ignore_errors=True)
    shutil.copytree(runs["tier"], job, symlinks=True)
    [step_dir] = [p for p in (job / "n2").glob("step-*") if (p / "COMMITTED").is_file()]
    shard = step_dir / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 3] ^= 0x10
    shard.write_bytes(bytes(data))
    env = {"FSDPJOB_MEMORY_TIER_DIR": str(runs["shm"])}
    assert run_ranks(node_worker, 2, run_dir=str(crashed), env=env, nodes=NODES) == [0, 0]
    [resume] = _events(crashed, "resume")
    assert resume["tier"] == "memory" and resume["checkpoint"].endswith(step_dir.name), resume
    assert any("__1_0.distcp on n2 fails its checksum" in why for why in resume["passed_over"]), resume
    a, b = committed_model_state(runs["full"]), committed_model_state(crashed)
    assert all((a[k] == b[k]).all() for k in a)


def test_full_shared_memory_turns_the_tier_off_and_the_run_ends_as_without_it(runs, tmp_path, assets):
    """ENOSPC: the tier's folder on a 64 KiB tmpfs (a node whose /dev/shm is full). The first snapshot fails, the
    tier goes off with a warning, and the run trains on from the durable tier to the uninterrupted run's bits."""
    small = tmp_path / "small-shm"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(small)], check=True)  # root, as CI
    try:
        run_dir = _run(tmp_path, "full-shm", assets)
        log = tmp_path / "ranks.log"
        codes = run_ranks(node_worker, 2, run_dir=str(run_dir), env={"FSDPJOB_MEMORY_TIER_DIR": str(small)},
                          nodes=NODES, log_file=str(log))
        left = [p.name for p in small.rglob("COMMITTED")]
    finally:
        subprocess.run(["umount", str(small)], check=True)
    assert codes == [0, 0]
    text = log.read_text()
    assert "No space left on device" in text and "memory tier off for the rest of this launch" in text, text
    assert left == []  # no snapshot was committed
    a, b = committed_model_state(runs["full"]), committed_model_state(run_dir)
    assert all((a[k] == b[k]).all() for k in a)


def test_auto_interval_probes_then_snapshots_as_its_measured_cost_says(tmp_path, assets):
    """memory_interval_steps: auto on 2 ranks (nodes n1, n2): a warm-up snapshot 5 steps into the launch (it pays the
    one-time staging allocation), the probe snapshot 5 steps later, the interval decided 5 steps after it from what
    the probe cost (one event, the profile's rate as the MTBI), and a crash after step 19 resumes from a snapshot of
    that schedule."""
    from fsdpjob.jobs.checkpoint.memory.schedule import auto_steps
    from fsdpjob.orchestrator.core.runfolder.memtier import MAX_STALL_SHARE

    run_dir = make_run(tmp_path, "auto", assets)
    meta = json.loads((run_dir / "spec.json").read_text())
    meta["spec"]["checkpoint"]["memory_interval_steps"] = "auto"
    meta["spec"]["train"]["max_steps"] = 24
    meta["profile"]["expected_interruptions_per_day"] = 2000.0  # per node: 2 nodes -> a fault every 21.6 s
    (run_dir / "spec.json").write_text(json.dumps(meta))
    env = {"FSDPJOB_MEMORY_TIER_DIR": str(tmp_path / "shm")}
    codes = exit_codes(node_worker, 2, run_dir=str(run_dir), env={**env, "FSDPJOB_FAULT_EXIT_STEP": "19"}, nodes=NODES)
    assert codes == [70, 70], codes
    [choice] = _events(run_dir, "memory_tier")
    warm_up, probe, decide = auto_steps(1)  # the first step a launch's tier sees follows its resume step (0 here)
    assert choice["at_step"] == decide and choice["mtbi_s"] == pytest.approx(21.6), choice
    assert choice["stall_s"] > 0 and choice["step_s"] > 0, choice
    # At least the stall bound, at least Young/Daly's optimum, in whole steps.
    bound = max(choice["stall_s"] / MAX_STALL_SHARE, (2 * choice["stall_s"] * choice["mtbi_s"]) ** 0.5)
    assert choice["steps"] == max(1, round(bound / choice["step_s"])), choice
    assert run_ranks(node_worker, 2, run_dir=str(run_dir), env=env, nodes=NODES) == [0, 0]
    [resume] = _events(run_dir, "resume")
    # The warm-up, the probe, then every `steps` from it, the first no earlier than the decision (taken at it when
    # due).
    snapshots = [warm_up, probe] + list(range(max(decide, probe + choice["steps"]), 19, choice["steps"]))
    assert resume["tier"] == "memory" and resume["step"] in snapshots[-2:], (resume, snapshots)
    assert [e["step"] for e in _events(run_dir, "done")] == [24]
