"""What the dev-cluster benches share: the fsdpjob CLI in a subprocess, a run's status, polling with a deadline."""

from __future__ import annotations

import json
import subprocess
import sys
import time


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
