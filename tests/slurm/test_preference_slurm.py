"""DPO on the real local Slurm cluster (2 nodes x 1 task): preempted inside its reference pass, or in training,
requeued, it ends with the weights of an uninterrupted DPO run, bit for bit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import wait_for
from slurm.slurm_helpers import final_weights, status, submit, wait_phase
from slurm.test_fsdp_slurm import preempt_now, release_when_held
from worker.test_preference_train import write_pairs

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

STEPS = 8


def _events(run_dir: str) -> list[dict]:
    return [json.loads(x) for x in Path(run_dir, "events.jsonl").read_text().splitlines()]


def _chunks(run_dir: str) -> int:
    return len(list(Path(run_dir, "reference").glob("*/chunk-*.pt")))


def test_dpo_preempted_in_its_reference_pass_or_in_training_ends_bitwise(slurm_cluster, make_spec, tmp_path):
    pairs = write_pairs(tmp_path / "pairs.jsonl", 32)  # 2 chunks of 8 pairs x 2 ranks: a stop between them
    options = {"data__path": str(pairs), "data__seq_len": 16, "train__method": "dpo", "train__max_steps": STEPS,
               "train__warmup_steps": 0, "train__micro_batch_size": 1, "train__lr": 2e-3}
    straight = submit(make_spec("dpo-straight", **options))
    assert wait_phase(straight["run_id"], {"COMPLETED", "FAILED"}, timeout=300)["phase"] == "COMPLETED"
    reference = final_weights(straight["run_dir"])

    # In the pass: each chunk of the first allocation's pass lasts 20 s, and the preemption lands inside it.
    in_pass = submit(make_spec("dpo-in-pass", **options), "--set", "env.FSDPJOB_MIN_CHUNK_S='20'")
    wait_for(lambda: _chunks(in_pass["run_dir"]) >= 1, timeout_s=180, interval_s=0.5, what="the pass's first chunk")
    # In training: each step of the first allocation lasts 3 s; preempted after step 4.
    in_training = submit(make_spec("dpo-in-training", **options), "--set", "env.FSDPJOB_MIN_STEP_S='3'")
    for run, started in ((in_pass, lambda r: True),
                         (in_training, lambda r: (status(r["run_id"])["step"] or 0) >= 4)):
        wait_for(lambda run=run, started=started: started(run), timeout_s=240, interval_s=1.0, what="the moment")
        preempt_now()
        assert wait_phase(run["run_id"], {"REQUEUED", "PENDING"}, timeout=120)["restarts"] >= 1
        release_when_held(run["job_id"])
    for run in (in_pass, in_training):
        done = wait_phase(run["run_id"], {"COMPLETED", "FAILED"}, timeout=300)
        assert done["phase"] == "COMPLETED" and done["step"] == STEPS and done["steps_lost"] == 0, done
        weights = final_weights(run["run_dir"])
        assert weights.keys() == reference.keys() and not [k for k in weights if not (weights[k] == reference[k]).all()]

    events = _events(in_pass["run_dir"])
    [stop] = [e for e in events if e["event"] == "stop"]
    assert stop["reason"] == "preemption" and stop["step"] == 0, stop
    passes = [e["phase"] for e in events if e["event"] == "reference"]
    assert passes == ["start", "stopped", "start", "done"], passes  # the second allocation resumed the pass
    kinds = [e["event"] for e in events if e["event"] in ("reference", "ready")]
    assert kinds[-2:] == ["reference", "ready"], kinds  # training starts after the pass
    [stop] = [e for e in _events(in_training["run_dir"]) if e["event"] == "stop"]
    assert stop["reason"] == "preemption" and stop["step"] >= 4, stop
