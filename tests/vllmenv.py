"""The vLLM environment of the tests that run grpo on vLLM for real (never a stand-in): the python that
``.ci/vllm-env`` built (``$FSDPJOB_VLLM_PYTHON``, which .ci/run exports, or found by ``.ci/vllm-env --find``: the
same cache path, keyed by what it installs). Without one those tests skip, or fail under ``FSDPJOB_REQUIRE_VLLM=1``
(CI). .ci/run builds it while the first tests run: ``$FSDPJOB_VLLM_BUILD_STATUS`` names the file its exit status is
written to when the build ends, which these tests wait for (conftest.py runs them after the slow tests that don't).
The Inductor cache beside it is kept across runs (TORCHINDUCTOR_CACHE_DIR: the first logprobs request compiles).
Also: the PYTHONPATH that makes this checkout importable in it (colocate's workers run it), and the tiny GRPO job
both vLLM tests run."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import helpers
import pytest
from helpers import ONE_THREAD

SCRIPT = Path(__file__).resolve().parents[1] / ".ci" / "vllm-env"
BUILD_WAIT_S = 45 * 60  # an uncached build is ~4-10 min on 2 cores; CI's whole run is bounded at 90 min


def vllm_python() -> str:
    """The vLLM environment's python; skips (or fails under FSDPJOB_REQUIRE_VLLM=1) when there is none."""
    python = os.environ.get("FSDPJOB_VLLM_PYTHON")
    reason = _build_failure()
    if reason:
        pytest.fail(reason, pytrace=False)
    if not python:
        found = subprocess.run([str(SCRIPT), "--find"], capture_output=True, text=True, timeout=60)
        python, reason = found.stdout.strip(), found.stderr.strip()
    if python and not Path(python).is_file():
        python, reason = "", f"FSDPJOB_VLLM_PYTHON={python} is not a file"
    if not python:
        if os.environ.get("FSDPJOB_REQUIRE_VLLM") == "1":
            pytest.fail(f"FSDPJOB_REQUIRE_VLLM=1 but {reason}", pytrace=False)
        pytest.skip(reason or "no vLLM environment")
    return python


def _build_failure() -> str | None:
    """Waits for a build in progress (``$FSDPJOB_VLLM_BUILD_STATUS``); its failure, with the log's end, or None."""
    status = os.environ.get("FSDPJOB_VLLM_BUILD_STATUS")
    if not status:
        return None
    status_file = Path(status)
    deadline = time.monotonic() + BUILD_WAIT_S
    while not status_file.exists():  # written once, by rename, when the build ends
        if time.monotonic() > deadline:
            return f"the vLLM environment's build (.ci/vllm-env) did not end within {BUILD_WAIT_S} s"
        time.sleep(2)
    code = status_file.read_text().strip()
    if code == "0":
        return None
    log = status_file.with_name("log")
    tail = log.read_text(errors="replace")[-1500:] if log.exists() else "(no log)"
    return f"the vLLM environment's build (.ci/vllm-env) failed with exit status {code}:\n{tail}"


# The checkout's folders that are fsdpjob's subpackages (pyproject's package-dir: fsdpjob.<part> = <part>/).
PARTS = ("orchestrator", "jobs", "templates", "cluster_profiles")


def colocate_pythonpath(folder: Path) -> str:
    """A PYTHONPATH entry that makes this checkout importable as ``fsdpjob`` in any interpreter (the vLLM
    environment runs colocate's workers; it is shared by every checkout, so fsdpjob is not installed in it):
    ``folder/fsdpjob/<part>`` links to the checkout's part (fsdpjob is a namespace package). The sources are the
    checkout's own, so the workers' build line equals the batch side's (core/buildid.py)."""
    root = Path(__file__).resolve().parents[1]
    package = folder / "fsdpjob"
    package.mkdir(parents=True, exist_ok=True)
    for part in PARTS:
        link = package / part
        if not link.exists():
            link.symlink_to(root / part, target_is_directory=True)
    return str(folder)


REWARDS = "def digits(prompts, completions, **fields):\n" \
          "    return [sum(c.isdigit() for c in t) / max(len(t), 1) for t in completions]\n"


def tiny_grpo_job(root: Path, name: str, *, steps: int, generator: dict, stall_floor_s: int,
                  env: dict | None = None) -> Path:
    """``root`` with ``grpo.yaml``: GRPO on vLLM (``generator``) on 2 local ranks, the quickstart's tiny model (built in
    ``root/assets``), 64 counting prompts, a reward for digits; 4 completions a prompt, 2 steps a round, a checkpoint
    every 3 steps."""
    helpers.fsdpjob("quickstart", str(root / "assets"), cwd=root, check=True, env=ONE_THREAD, timeout_s=1500)
    (root / "rewards.py").write_text(REWARDS)
    (root / "prompts.jsonl").write_text("".join(json.dumps({"prompt": f"count {i}:"}) + "\n" for i in range(64)))
    spec = {"name": name, "profile": "local", "resources": {"tasks_per_node": 2, "time_limit": "40:00"},
            "model": {"path": str(root / "assets" / "model")}, "data": {"path": "prompts.jsonl", "seq_len": 24},
            "train": {"method": "grpo", "max_steps": steps, "micro_batch_size": 4, "grad_accum_steps": 2,
                      "lr": 3e-3, "log_every": 1, "lr_schedule": "constant"},
            "fsdp": {"mixed_precision": "fp32"}, "checkpoint": {"interval_steps": 3, "interval_minutes": 0},
            "recovery": {"stall_floor_s": stall_floor_s}, **({"env": env} if env else {}),
            "grpo": {"reward": ["rewards.py:digits"], "num_generations": 4, "max_new_tokens": 10,
                     "steps_per_generation": 2, "generator": generator}}
    (root / "grpo.yaml").write_text(json.dumps(spec))
    return root


def submit_grpo(root: Path, name: str, *sets: str, wait: bool = True) -> dict:
    """``fsdpjob submit`` of ``root``'s grpo.yaml (tiny_grpo_job) under ``name``, with ``--set`` options; its record."""
    extra = [a for s in sets for a in ("--set", s)]
    done = helpers.fsdpjob("submit", "grpo.yaml", "--json", "--set", f"name={name}", *extra,
                           *(["--wait"] if wait else []), cwd=root, env=ONE_THREAD, timeout_s=1500)
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(done.stdout[: done.stdout.index("}") + 1])


def run_events(run: dict) -> list[dict]:
    """The run's events.jsonl (none yet: empty)."""
    path = Path(run["run_dir"]) / "events.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
