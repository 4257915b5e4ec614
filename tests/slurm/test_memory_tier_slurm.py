"""Issue 27 on the real dev cluster (2 nodes x 1 task): a rank SIGKILLed at a random step, with the durable
checkpoint far away and the memory tier every 5 steps, restarts in the allocation from the memory tier, loses at
most 5 steps, completes, and ends with the uninterrupted run's bits; the tier is gone at the end, from every node.
A tier spoiled after a crash (parts missing, a stale job id) is never chosen: the durable checkpoint serves."""

from __future__ import annotations

import json
import os
import random
import subprocess

import pytest
from helpers import wait_for
from slurm.slurm_helpers import status, submit
from slurm.test_fsdp_slurm import assert_same_weights
from slurm.test_recovery_slurm import _events, _finished, _kill_at, _one_allocation

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

EVERY = 5


def test_killed_rank_resumes_from_the_memory_tier(slurm_cluster, reference, tmp_path, in_container):
    """In the test image (issue 36 item 7): the tier's folder outside /dev is mounted into the container and made on
    every node before the first launch; it does not exist at submit."""
    shm = tmp_path / "shm"  # node-local on the dev cluster's one host; its own per test (/dev/shm is shared)
    assert not shm.exists()
    run = submit(reference["spec"], "--set", "checkpoint.interval_steps=1000", "--set", "checkpoint.interval_minutes=0",
                 "--set", f"checkpoint.memory_interval_steps={EVERY}", "--set", "recovery.stall_floor_s=5",
                 "--set", "recovery.setup_timeout_s=600", "--set", f"env.FSDPJOB_MEMORY_TIER_DIR='{shm}'",
                 *in_container)
    # Seeded, and the seed printed, so that a failure can be replayed (FSDPJOB_TIER_KILL_SEED=<seed>).
    seed = int(os.environ.get("FSDPJOB_TIER_KILL_SEED", str(random.SystemRandom().randrange(10**6))))
    rng = random.Random(seed)
    step, rank = rng.randint(12, 40), rng.choice([0, 1])
    print(f"memory tier kill: seed {seed}: rank {rank} at step {step}")
    _kill_at(run, launch=0, step=step, rank=rank)
    done = _finished(run)
    [fault] = _one_allocation(run, launches=2)
    assert fault["kind"] == "crash", fault
    [resume] = [e for e in _events(run["run_dir"]) if e["event"] == "resume"]
    assert resume["tier"] == "memory" and resume["step"] % EVERY == 0 and resume["step"] >= step - EVERY, resume
    # status's steps lost: the furthest step trained before the crash, less the step the restart resumed from.
    assert done["steps_lost"] <= EVERY, (done["steps_lost"], resume, step, seed)
    assert done["recovery"]["last_resume"] == {"tier": "memory", "step": resume["step"]}, done["recovery"]
    assert not checkpoints_between(run["run_dir"], 1, 59), "a durable interval save happened"
    assert_same_weights(reference, run["run_dir"])
    assert not (shm / run["job_id"]).exists() or not any((shm / run["job_id"]).iterdir())
    assert status(run["run_id"])["phase"] == "COMPLETED"
    # The supervisor removed the tier on every node too (one host holds both node folders here, so Slurm's
    # accounting is what shows it ran on each): an `rm` step per node.
    def rm_steps() -> set[str]:
        out = subprocess.run(["sacct", "-j", run["job_id"], "-n", "-P", "--format=JobName,NodeList"],
                             capture_output=True, text=True).stdout
        return {line.split("|")[1] for line in out.splitlines() if line.startswith("rm|")}
    assert wait_for(lambda: rm_steps() == {"n1", "n2"}, timeout_s=30, interval_s=1.0, what="the rm steps"), rm_steps()


def checkpoints_between(run_dir: str, first: int, last: int) -> list[int]:
    return [e["step"] for e in _events(run_dir) if e["event"] == "checkpoint" and first <= e["step"] <= last]


def test_a_damaged_or_stale_tier_is_never_chosen_and_the_durable_checkpoint_serves(slurm_cluster, reference, tmp_path):
    """The tier every 3 steps, durable checkpoints every 10. Right after a rank is SIGKILLed, every snapshot left in
    shared memory is spoiled before the supervisor's next launch scans it: on n1 the parts are gone (no file is
    known complete), on n2 the COMMITTED marker names another job (a stale tier). The restart resumes from the
    newest durable checkpoint and ends with the uninterrupted run's bits."""
    shm = tmp_path / "shm"
    run = submit(reference["spec"], "--set", "checkpoint.interval_steps=10", "--set", "checkpoint.interval_minutes=0",
                 "--set", "checkpoint.memory_interval_steps=3", "--set", "recovery.stall_floor_s=5",
                 "--set", "recovery.setup_timeout_s=600", "--set", f"env.FSDPJOB_MEMORY_TIER_DIR='{shm}'")
    _kill_at(run, launch=0, step=24, rank=1)
    job = shm / run["job_id"]
    spoiled = []
    for step_dir in sorted(job.glob("n1/step-*")):
        for part in step_dir.glob("part-*.json"):
            part.unlink()
        spoiled.append(("n1", step_dir.name))
    for marker in sorted(job.glob("n2/step-*/COMMITTED")):
        record = json.loads(marker.read_text())
        marker.write_text(json.dumps({**record, "job": "999999"}) + "\n")
        spoiled.append(("n2", marker.parent.name))
    assert {node for node, _ in spoiled} == {"n1", "n2"}, spoiled
    done = _finished(run)
    [fault] = _one_allocation(run, launches=2)
    assert fault["kind"] == "crash", fault
    [resume] = [e for e in _events(run["run_dir"]) if e["event"] == "resume"]
    assert resume["tier"] == "durable" and resume["step"] % 10 == 0 and resume["step"] >= 20, (resume, spoiled)
    assert done["recovery"]["last_resume"] == {"tier": "durable", "step": resume["step"]}, done["recovery"]
    assert_same_weights(reference, run["run_dir"])
