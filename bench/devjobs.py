"""What the dev-cluster benches share: the fsdpjob CLI in a subprocess, a run's status, polling with a deadline."""

from __future__ import annotations

import json
import subprocess
import sys
import time


def recovery_spec(name: str, assets: dict) -> dict:
    """The recovery benches' run: the quickstart model on the dev cluster's 2 nodes x 2 tasks, 400 steps, a
    durable checkpoint every 20 steps; the benches change what they measure."""
    return {
        "name": name, "profile": "test-cluster",
        "resources": {"nodes": 2, "time_limit": "30:00"},
        "model": {"path": assets["model_path"]},
        "data": {"path": assets["data_path"], "seq_len": 64},
        "train": {"max_steps": 400, "micro_batch_size": 2, "lr": 3e-3, "log_every": 1},
        "fsdp": {"mixed_precision": "fp32"},
        "checkpoint": {"interval_steps": 20, "interval_minutes": 0},
    }


def cli(*args: str) -> str:
    proc = subprocess.run([sys.executable, "-m", "fsdpjob.orchestrator.cli", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"fsdpjob {' '.join(args)} failed:\n{proc.stderr}")
    return proc.stdout


def status(run_id: str) -> dict:
    return json.loads(cli("status", run_id, "--json"))


def poll(predicate, timeout: float, what: str):
    end = time.time() + timeout
    while time.time() < end:
        value = predicate()
        if value:
            return value
        time.sleep(0.5)
    raise SystemExit(f"timed out waiting for {what}")
