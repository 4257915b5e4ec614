"""bench/varlen_attention.py runs end to end on CPU (--tiny): the GPU run's script cannot first fail on a GPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_varlen_bench_tiny_checks_correctness_and_times_the_three_paths():
    done = subprocess.run([sys.executable, str(REPO / "bench" / "varlen_attention.py"), "--tiny"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert rows[0]["part"] == "correctness" and rows[0]["max_rel_error"] < 1e-4
    assert rows[1]["tokens"] == 512 and set(rows[1]["ms_fwd_bwd"]) == {"varlen", "sdpa_dense_mask",
                                                                        "sdpa_causal_no_mask"}
