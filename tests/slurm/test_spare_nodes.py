"""Issue 27 part 5, on the 4-node dev cluster (partition `wide` on n[1-4]; the 2-node clusters and their tests are
untouched): what needs spare nodes. A lost node of a job that cannot go on without it (min_nodes = nodes) is left
behind by a requeue that excludes it, and the job lands on the other nodes and completes; a 4-node job with
min_nodes 3 loses one node (its slurmd, its rank and its shared memory) and goes on with 3 in its allocation,
resharded from the memory tier's replicas. One task per node, the tiny model, 24 steps: the CI cost stays small."""

from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path

import pytest
from helpers import wait_for
from slurm.slurm_helpers import final_weights, release_held, status, submit, wait_phase

from fsdpjob.orchestrator.core.errors import FsdpjobError
from fsdpjob.orchestrator.devcluster import manage
from fsdpjob.orchestrator.slurm import commands as slurm_cli

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

# Checkpoints every 5 steps; short bounds keep the tests short (as in test_recovery_slurm.py).
FAST = ("--set", "checkpoint.interval_steps=5", "--set", "recovery.stall_floor_s=5",
        "--set", "recovery.setup_timeout_s=120")


def _spec(make_spec, name: str, nodes: int, min_nodes: int, grad_accum: int = 3) -> Path:
    # Global batch 1 x 3 x nodes: divisible by (nodes - 1) ranks too, so 4 -> 3 keeps it by accumulation.
    return make_spec(name, resources__nodes=nodes, resources__min_nodes=min_nodes, resources__gpus_per_node=1,
                     resources__partition="wide", train__max_steps=24, train__micro_batch_size=1,
                     train__grad_accum_steps=grad_accum)


def _events(run_dir: str) -> list[dict]:
    return [json.loads(x) for x in Path(run_dir, "events.jsonl").read_text().splitlines()]


def _tier_log(run_dir: str) -> list[str]:
    """The workers' memory-tier log lines (commits, skipped steps, the tier turned off), for a failure's message."""
    return [line for f in sorted(Path(run_dir, "submitit").glob("*_log.*"))
            for line in f.read_text(errors="replace").splitlines() if "memory tier" in line]


def _lose_last_node(cluster, run: dict, step: int) -> str:
    """Once the run trained past ``step``: SIGKILL the slurmd of the job's last node (not the batch host) and the
    rank on it, as a node that dies would leave things. Returns the node."""
    wait_for(lambda: (status(run["run_id"])["step"] or 0) >= step, timeout_s=300, interval_s=1.0, what=f"step {step}")
    nodes = slurm_cli.hostnames(slurm_cli.scontrol_job(run["job_id"])["NodeList"])
    victim = nodes[-1]
    beat = json.loads(Path(run["run_dir"], "heartbeat", f"rank-{len(nodes) - 1}.json").read_text())
    assert beat["host"] == victim, beat
    os.kill(int((Path(cluster.state_dir) / "run" / f"slurmd.{victim}.pid").read_text().split()[0]), signal.SIGKILL)
    os.kill(beat["pid"], signal.SIGKILL)
    return victim


def _slurmd_back(cluster) -> None:
    """The killed slurmd back (the job cannot finish COMPLETING without it); exclusion keeps the run off it."""
    manage.up(accounting=cluster.accounting, state_dir=str(cluster.state_dir))


def test_four_nodes_partitions_and_mode(slurm_cluster4):
    """`up --nodes 4`: four slurmd, debug and high still on n[1-2] (a 3-node job there can never run), `wide` on
    all four; status reads the node count from the mode file, and an `up` with another count is refused."""
    report = manage.status(str(slurm_cluster4.state_dir))
    assert report.startswith("cluster: up") and "nodes: 4" in report, report
    assert all(f"slurmd-n{i}" in report for i in range(1, 5)), report
    parts = dict(line.split() for line in slurm_cli.run(["sinfo", "-h", "-o", "%R %N"]).splitlines())
    assert parts == {"debug": "n[1-2]", "high": "n[1-2]", "wide": "n[1-4]"}, parts
    with pytest.raises(FsdpjobError, match="running with 4 nodes; run 'down' first"):
        manage.up(accounting=False, state_dir=str(slurm_cluster4.state_dir), nodes=2)


def test_lost_node_without_spare_in_the_allocation_requeues_onto_other_nodes(slurm_cluster4, make_spec):
    run = submit(_spec(make_spec, "exclude", nodes=2, min_nodes=2), *FAST)
    victim = _lose_last_node(slurm_cluster4, run, step=12)
    try:
        fault = wait_for(lambda: next((e for e in _events(run["run_dir"]) if e["event"] == "fault"), None),
                         timeout_s=180, interval_s=1.0, what="the supervisor's verdict on the lost node")
    finally:
        _slurmd_back(slurm_cluster4)
    # Going on with 1 node is below min_nodes 2: the supervisor gives up on the allocation, naming the node.
    assert fault["kind"] == "crash" and fault["exclude"] == [victim] and fault["restart"] is False, fault
    requeue = wait_for(lambda: next((e for e in _events(run["run_dir"]) if e["event"] == "requeue"), None),
                       timeout_s=180, interval_s=1.0, what="the failure policy's requeue")
    assert requeue["reason"] == "failure" and requeue["exclusion"] == f"excluded {victim}", requeue
    release_held(run["job_id"])  # tests only: skip the 120 s BeginTime hold
    done = wait_phase(run["run_id"], {"COMPLETED", "FAILED", "CANCELLED"}, timeout=420)
    assert done["phase"] == "COMPLETED" and done["step"] == 24, done
    job = slurm_cli.scontrol_job(run["job_id"])
    assert victim in job["ExcNodeList"].split(",") and int(job["Restarts"]) == 1, job
    second = slurm_cli.hostnames(job["NodeList"])
    assert len(second) == 2 and victim not in second, job
    events = _events(run["run_dir"])
    starts = [e for e in events if e["event"] == "start"]
    assert [e["restart"] for e in starts] == [0, 1], starts
    resume = [e for e in events if e["event"] == "resume"][-1]
    # The durable checkpoint the fault names (the newest committed: 10, or 5 if 10's save was still in flight).
    assert resume["step"] == fault["step"] >= 5 and resume["world_size"] == 2 and resume["grad_accum_steps"] == 3, (
        resume, fault)


SHRINK_MAX_DIFF = 2e-6  # about 3 x the 6.2e-7 measured at 51acd79


def test_one_node_of_four_lost_goes_on_with_three_from_the_memory_tiers_replicas(slurm_cluster4, make_spec, tmp_path):
    """The shrink, then its final weights against an uninterrupted run of the same global batch of 12 samples a
    step, on one node and one rank (12 micro-batches accumulated: the cheapest reference; the data order is the
    same for every world size): equal within fp32 reduction tolerance (4, then 3 ranks sum in another order)."""

    every = 4
    reference = submit(_spec(make_spec, "shrink-reference", nodes=1, min_nodes=1, grad_accum=12))
    assert wait_phase(reference["run_id"], {"COMPLETED", "FAILED", "CANCELLED"}, timeout=420)["phase"] == "COMPLETED"
    shm = tmp_path / "shm"  # the emulated nodes share one host's /dev/shm: a folder per node, this test's own
    run = submit(_spec(make_spec, "shrink", nodes=4, min_nodes=3), "--set", "checkpoint.interval_steps=1000",
                 "--set", "checkpoint.interval_minutes=0", "--set", f"checkpoint.memory_interval_steps={every}",
                 "--set", "recovery.stall_floor_s=5", "--set", "recovery.setup_timeout_s=120",
                 "--set", f"env.FSDPJOB_MEMORY_TIER_DIR='{shm}'")
    victim = _lose_last_node(slurm_cluster4, run, step=12)
    shutil.rmtree(shm / run["job_id"] / victim)  # the node's memory went with it: only its buddy's replica is left
    try:
        wait_for(lambda: (status(run["run_id"])["recovery"] or {}).get("restarts") == 1, timeout_s=180,
                 interval_s=1.0, what=f"the restart without {victim}")
    finally:
        _slurmd_back(slurm_cluster4)
    done = wait_phase(run["run_id"], {"COMPLETED", "FAILED", "CANCELLED"}, timeout=420)
    assert done["phase"] == "COMPLETED" and done["step"] == 24 and done["restarts"] == 0, done
    events = _events(run["run_dir"])
    [fault] = [e for e in events if e["event"] == "fault"]
    assert fault["exclude"] == [victim] and fault["restart"] is True, fault
    assert not [e for e in events if e["event"] == "requeue"], events
    resumes = [e for e in events if e["event"] == "resume"]
    assert resumes, (events, _tier_log(run["run_dir"]))
    resume = resumes[-1]
    # A snapshot of the memory tier (no durable checkpoint before the end), the victim's shard from its buddy's
    # replica, resharded from 4 ranks onto 3, the global batch of 12 kept (3 ranks x 4 micro-batches).
    assert resume["tier"] == "memory" and resume["step"] % every == 0 and resume["step"] >= 8, resume
    assert resume["world_size"] == 3 and resume["grad_accum_steps"] == 4, resume
    assert not [e for e in events if e["event"] == "checkpoint" and e["step"] < 24], events
    final = status(run["run_id"])
    assert final["recovery"]["excluded_nodes"] == [victim], final["recovery"]
    assert final["recovery"]["last_resume"] == {"tier": "memory", "step": resume["step"]}, final["recovery"]
    a, b = final_weights(reference["run_dir"]), final_weights(run["run_dir"])
    assert a.keys() == b.keys()
    # Near the difference measured (bench/RESULTS.md: max 6.2e-7 over the 39 tensors; 4 then 3 ranks sum in other
    # orders than one), not fp32's generic 1e-3: a wrong scale of the accumulated gradient must not pass.
    worst = max(float((a[k] - b[k]).abs().max()) for k in a)
    assert worst <= SHRINK_MAX_DIFF, {k: float((a[k] - b[k]).abs().max()) for k in a}
