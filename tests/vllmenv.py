"""The vLLM environment of the tests that run grpo on vLLM for real (never a stand-in): the python that
``.ci/vllm-env`` built (``$FSDPJOB_VLLM_PYTHON``, which .ci/run exports, or found by ``.ci/vllm-env --find``: the
same cache path, keyed by the pins). Without one those tests skip, or fail under ``FSDPJOB_REQUIRE_VLLM=1`` (CI).
The Inductor cache beside it is kept across runs (TORCHINDUCTOR_CACHE_DIR: the first logprobs request compiles)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / ".ci" / "vllm-env"


def vllm_python() -> str:
    """The vLLM environment's python; skips (or fails under FSDPJOB_REQUIRE_VLLM=1) when there is none."""
    python = os.environ.get("FSDPJOB_VLLM_PYTHON")
    reason = None
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
