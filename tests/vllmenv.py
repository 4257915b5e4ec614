"""The vLLM environment of the tests that run grpo on vLLM for real (never a stand-in): the python that
``.ci/vllm-env`` built (``$FSDPJOB_VLLM_PYTHON``, which .ci/run exports, or found by ``.ci/vllm-env --find``: the
same cache path, keyed by the pins). Without one those tests skip, or fail under ``FSDPJOB_REQUIRE_VLLM=1`` (CI).
.ci/run builds it while the first tests run: ``$FSDPJOB_VLLM_BUILD_STATUS`` names the file its exit status is
written to when the build ends, which these tests wait for (conftest.py runs them after the slow tests that don't).
The Inductor cache beside it is kept across runs (TORCHINDUCTOR_CACHE_DIR: the first logprobs request compiles)."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

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
