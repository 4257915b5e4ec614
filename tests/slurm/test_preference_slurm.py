"""DPO on the real local Slurm cluster (2 nodes x 2 tasks): preempted inside its reference pass and again in
training, requeued twice, it ends with the weights of an uninterrupted DPO run, bit for bit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import wait_for
from slurm.slurm_helpers import final_weights, status, submit, wait_phase
from slurm.test_fsdp_slurm import preempt_now, release_when_held
from worker.test_preference_train import write_pairs

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

STEPS = 12


def _events(run_dir: str) -> list[dict]:
    return [json.loads(x) for x in Path(run_dir, "events.jsonl").read_text().splitlines()]


def _chunks(run_dir: str) -> int:
    return len(list(Path(run_dir, "reference").glob("*/chunk-*.pt")))


def test_dpo_preempted_in_its_reference_pass_and_in_training_ends_bitwise(slurm_cluster, make_spec, tmp_path):
    pairs = write_pairs(tmp_path / "pairs.jsonl", 96)  # 3 chunks of 8 pairs x 4 ranks
    options = {"data__path": str(pairs), "data__seq_len": 16, "train__method": "dpo", "train__max_steps": STEPS,
               "train__warmup_steps": 0, "train__micro_batch_size": 1, "train__lr": 2e-3}
    straight = submit(make_spec("dpo-straight", **options))
    assert wait_phase(straight["run_id"], {"COMPLETED", "FAILED"}, timeout=300)["phase"] == "COMPLETED"

    # Each chunk of the first allocation's pass lasts 20 s: the preemption lands inside it.
    run = submit(make_spec("dpo-preempted", **options), "--set", "env.FSDPJOB_MIN_CHUNK_S='20'")
    wait_for(lambda: _chunks(run["run_dir"]) >= 1, timeout_s=180, interval_s=0.5, what="the pass's first chunk")
    preempt_now()
    assert wait_phase(run["run_id"], {"REQUEUED", "PENDING"}, timeout=120)["restarts"] >= 1
    release_when_held(run["job_id"])
    wait_for(lambda: (status(run["run_id"])["step"] or 0) >= 5, timeout_s=240, interval_s=1.0, what="step 5")
    preempt_now()
    wait_for(lambda: sum(e["event"] == "stop" for e in _events(run["run_dir"])) >= 2, timeout_s=120,
             interval_s=1.0, what="the second stop")
    release_when_held(run["job_id"])
    done = wait_phase(run["run_id"], {"COMPLETED", "FAILED"}, timeout=300)
    assert done["phase"] == "COMPLETED" and done["step"] == STEPS and done["steps_lost"] == 0, done

    events = _events(run["run_dir"])
    stops = [e for e in events if e["event"] == "stop"]
    assert [s["reason"] for s in stops] == ["preemption", "preemption"] and stops[0]["step"] == 0, stops
    passes = [e["phase"] for e in events if e["event"] == "reference"]
    assert passes == ["start", "stopped", "start", "done"], passes  # the second allocation resumed the pass
    a, b = final_weights(straight["run_dir"]), final_weights(run["run_dir"])
    assert a.keys() == b.keys() and not [k for k in a if not (a[k] == b[k]).all()]
