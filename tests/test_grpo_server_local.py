"""GRPO with its generation server on the local profile (issue 40 item 2): the supervisor starts the server beside
the workers and waits for it to answer; the ranks publish the policy before each round and generate on it. A
server frozen with SIGSTOP makes the ranks' requests fail at grpo.generator.deadline_s (never an endless wait);
the supervisor restarts the workers and a new server in the same run, and the run ends with the weights of an
uninterrupted run, bit for bit (the server samples each completion from its own seed at a pinned thread count)."""

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

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
fsdpjob = partial(helpers.fsdpjob, env=ONE_THREAD, timeout_s=600)
STEPS, DEADLINE_S = 8, 10
REWARDS = "def digits(prompts, completions, **fields):\n" \
          "    return [sum(c.isdigit() for c in t) / max(len(t), 1) for t in completions]\n"


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("grpo-server")
    fsdpjob("quickstart", str(root / "assets"), cwd=root, check=True)
    (root / "rewards.py").write_text(REWARDS)
    (root / "prompts.jsonl").write_text("".join(json.dumps({"prompt": f"count {i}:"}) + "\n" for i in range(64)))
    spec = {"name": "grpo-server", "profile": "local", "resources": {"tasks_per_node": 2, "time_limit": "20:00"},
            "model": {"path": str(root / "assets" / "model")}, "data": {"path": "prompts.jsonl", "seq_len": 24},
            "train": {"method": "grpo", "max_steps": STEPS, "micro_batch_size": 4, "grad_accum_steps": 2,
                      "lr": 3e-3, "log_every": 1, "lr_schedule": "constant"},
            "fsdp": {"mixed_precision": "fp32"}, "checkpoint": {"interval_steps": 2, "interval_minutes": 0},
            "recovery": {"stall_floor_s": 60},
            "grpo": {"reward": ["rewards.py:digits"], "num_generations": 4, "max_new_tokens": 10,
                     "generator": {"backend": "server", "deadline_s": DEADLINE_S}}}
    (root / "grpo.yaml").write_text(json.dumps(spec))
    return root


def _submit(root: Path, name: str, *, wait: bool, pace_s: float = 0) -> dict:
    paced = ["--set", f"env.FSDPJOB_MIN_STEP_S='{pace_s}'"] if pace_s else []
    done = fsdpjob("submit", "grpo.yaml", "--json", "--set", f"name={name}", *paced, *(["--wait"] if wait else []),
                   cwd=root)
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(done.stdout[: done.stdout.index("}") + 1])


def _events(run: dict) -> list[dict]:
    return [json.loads(x) for x in (Path(run["run_dir"]) / "events.jsonl").read_text().splitlines()]


def _status(root: Path, run: dict) -> dict:
    return status_json(run["run_id"], cwd=root)


def _server_pid(run: dict) -> int:
    ready = str(Path(run["run_dir"]) / "generation-server" / "ready")
    found = subprocess.run(["pgrep", "-f", ready], capture_output=True, text=True).stdout.split()
    servers = [int(pid) for pid in found
               if Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[1:3] == [b"-m", b"fsdpjob.jobs.grpo.server"]]
    assert len(servers) == 1, [(pid, Path(f"/proc/{pid}/cmdline").read_bytes()[:300]) for pid in found]
    return servers[0]


def test_a_frozen_server_is_detected_at_its_deadline_restarted_and_the_run_ends_bitwise(root: Path) -> None:
    straight = _submit(root, "straight", wait=True)
    report = _status(root, straight)
    assert report["phase"] == "COMPLETED" and report["step"] == STEPS and report["reward"] is not None, report
    [ready] = [e for e in _events(straight) if e["event"] == "server"]
    assert ready["phase"] == "ready" and ready["address"].startswith("127.0.0.1:"), ready
    published = sorted(p.name for p in (Path(straight["run_dir"]) / "generation-server" / "weights").iterdir())
    assert published == ["v00000006.safetensors", "v00000007.safetensors"]  # the newest two policies

    # Its steps paced to >= 2 s (FSDPJOB_MIN_STEP_S; a local run has no requeue): the freeze sent after step 3 lands
    # before step 8 however fast the machine trains (unpaced, a quiet one trains a step in ~0.5 s).
    frozen = _submit(root, "frozen", wait=False, pace_s=2)
    wait_for(lambda: (_status(root, frozen)["step"] or 0) >= 3, 300, interval_s=0.5, what="step 3")
    os.kill(_server_pid(frozen), signal.SIGSTOP)
    report = wait_for(lambda: (r := _status(root, frozen))["phase"] in ("COMPLETED", "FAILED") and r, 500,
                      interval_s=1.0, what="the frozen run to end")
    assert report["phase"] == "COMPLETED" and report["step"] == STEPS, report
    events = _events(frozen)
    failed = [e for e in events if e["event"] == "failed"]
    assert failed and any("generation server" in e["error"] and f"deadline {DEADLINE_S}" in e["error"]
                          for e in failed), failed
    assert all(e["retryable"] for e in failed), failed
    [fault] = [e for e in events if e["event"] == "fault"]
    assert fault["kind"] == "crash" and fault["restart"] is True, fault
    assert [e["start"] for e in events if e["event"] == "server"] == [1, 2]  # a new server for the new launch
    # The new launch resumed from a step saved before the freeze, not from step 0 (the same bits either way).
    resumed_where_saved(events, 1)
    a, b = committed_model_state(straight["run_dir"]), committed_model_state(frozen["run_dir"])
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)
