"""Issue 55 on the real dev cluster (2 nodes x 1 task): a durable checkpoint whose bytes changed on disk is never
loaded (its checksums fail; the restart resumes from the previous step and the run ends with the uninterrupted
run's bits), and a checkpoint folder whose file system fills during a save stops the run cleanly, telling the user
ENOSPC, the folder and the free bytes, with no half-written step left. Each fault's step is drawn from a printed
seed (FSDPJOB_CKPT_FAULT_SEED)."""

from __future__ import annotations

import os
import random
import subprocess
from pathlib import Path

import pytest
from slurm.slurm_helpers import submit, wait_phase
from slurm.test_fsdp_slurm import assert_same_weights
from slurm.test_recovery_slurm import FAST, _events, _finished, _kill_at, _one_allocation

from fsdpjob.orchestrator.core.runfolder.ckptlayout import committed_steps, step_dir_name

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def _seeded() -> random.Random:
    seed = int(os.environ.get("FSDPJOB_CKPT_FAULT_SEED", str(random.SystemRandom().randrange(10**6))))
    print(f"checkpoint fault seed {seed}")
    return random.Random(seed)


def test_a_corrupted_newest_checkpoint_is_skipped_and_the_run_ends_bitwise(slurm_cluster, reference):
    """Rank 1 SIGKILLed at a seeded step; at once (the restart takes seconds to reach its resume) one byte of the
    newest committed step's shard of rank 1 is flipped. The restart passes it over (said in the resume event) and
    resumes from the step before; the run completes in its allocation with the uninterrupted run's weights."""
    rng = _seeded()
    run = submit(reference["spec"], *FAST)
    _kill_at(run, launch=0, step=rng.randint(16, 40), rank=1)
    root = Path(run["run_dir"], "checkpoints")
    newest, newest_dir = committed_steps(root)[-1]
    shard = newest_dir / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
    shard.write_bytes(bytes(data))
    _finished(run)
    [fault] = _one_allocation(run, launches=2)
    assert fault["kind"] == "crash", fault
    [resume] = [e for e in _events(run["run_dir"]) if e["event"] == "resume"]
    assert resume["step"] < newest, (resume, newest)
    assert any(p.startswith(step_dir_name(newest)) and "__1_0.distcp" in p for p in resume["passed_over"]), resume
    assert_same_weights(reference, run["run_dir"])


def test_a_full_checkpoint_disk_stops_the_run_cleanly_and_says_so(slurm_cluster, reference, tmp_path):
    """checkpoint.dir on a tmpfs with room for one step and a half (sized from the reference run's last step): the
    second interval save fails with ENOSPC on every rank; the run stops (not retryable: a restart would fill the disk
    again), the failure names ENOSPC, the folder and its free bytes, and only the first step is committed."""
    final = committed_steps(Path(reference["run_dir"], "checkpoints"))[-1][1]  # the reference's final step
    step_bytes = sum(f.stat().st_size for f in final.iterdir())
    small = tmp_path / "small"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={step_bytes * 3 // 2 // 1024 + 4}k", "tmpfs", str(small)],
                   check=True)
    try:
        every = _seeded().randint(5, 15)
        run = submit(reference["spec"], *FAST, "--set", f"checkpoint.interval_steps={every}",
                         "--set", f"checkpoint.dir={small}")
        done = wait_phase(run["run_id"], {"COMPLETED", "FAILED", "CANCELLED"}, timeout=420)
        committed = [s for s, _ in committed_steps(small)]
        left = sorted(p.name for p in small.iterdir())
    finally:
        subprocess.run(["umount", str(small)], check=True)
    assert done["phase"] == "FAILED", done
    failed = [e for e in _events(run["run_dir"]) if e["event"] == "failed" and "error" in e]
    assert failed and all("ENOSPC" in e["error"] and str(small) in e["error"] and "bytes free there" in e["error"]
                          and e["retryable"] is False for e in failed), failed
    assert committed == [every] and left == ["latest", step_dir_name(every)], (committed, left)

