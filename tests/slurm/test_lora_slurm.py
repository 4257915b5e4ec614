"""LoRA on the real local Slurm cluster: one 2-node x 2-task job, preempted mid-run, saves its adapters,
requeues, resumes from that step and completes without lost steps. (That a stop and resume give bitwise the
adapters of an uninterrupted run is shown on local gloo ranks in tests/worker/test_lora.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import wait_for
from slurm.slurm_helpers import final_weights, status, submit, wait_phase
from slurm.test_fsdp_slurm import preempt_now, release_when_held

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

STEPS = 30


def test_preempted_lora_job_saves_adapters_requeues_and_completes(slurm_cluster, make_spec):
    # The first allocation's steps paced to >= 1 s (FSDPJOB_MIN_STEP_S): unpaced, a quiet machine trains a LoRA
    # step in ~0.1 s, and the run finished its 30 steps before the preemption sent after step 5 landed (seen in CI).
    spec = make_spec("lora-preempted", train__max_steps=STEPS, model__lora={"r": 4, "alpha": 8},
                     model__activation_checkpointing=True, env={"FSDPJOB_MIN_STEP_S": "1"})
    run = submit(spec)
    wait_for(lambda: (status(run["run_id"])["step"] or 0) >= 5, timeout_s=180, interval_s=1.0, what="step 5")
    preempt_now()
    interrupted = wait_phase(run["run_id"], {"REQUEUED", "PENDING"}, timeout=120)
    assert interrupted["restarts"] >= 1
    release_when_held(run["job_id"])
    done = wait_phase(run["run_id"], {"COMPLETED", "FAILED"}, timeout=300)
    assert done["phase"] == "COMPLETED", done
    assert done["restarts"] >= 1 and done["steps_lost"] == 0 and done["step"] == STEPS

    events = [json.loads(x) for x in Path(run["run_dir"], "events.jsonl").read_text().splitlines()]
    stop = next(e for e in events if e["event"] == "stop")
    assert stop["reason"] == "preemption" and stop["requeued"] is True
    assert next(e for e in events if e["event"] == "resume")["step"] == stop["step"]
    weights = final_weights(run["run_dir"])  # the committed model state: the adapters and nothing else
    assert weights and all(".lora_A." in k or ".lora_B." in k for k in weights), sorted(weights)[:5]
