"""bench/gpu.py --tiny keeps running on CPU: the script the one GPU run depends on is checked in CI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.distributed
def test_gpu_bench_tiny_writes_one_json_per_case_and_a_table(tmp_path: Path) -> None:
    out = tmp_path / "results"
    cases = ["bare", "fsdpjob", "save-sync", "save-async", "fsdpjob-packing"]
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "gpu.py"), "--tiny", "--cases", *cases, "--out", str(out)],
        capture_output=True, text=True, timeout=900, cwd=tmp_path, env=dict(os.environ, OMP_NUM_THREADS="1"),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    records = {case: json.loads((out / f"{case}.json").read_text()) for case in cases}
    for case in cases:
        assert "error" not in records[case] and records[case]["rate"] > 0, records[case]
    assert records["save-async"]["save_s"] is not None  # one save mid-run, timed in the loop
    # What the async save blocked: the call plus the next step's wait at the staging gate (none where the stager
    # copied in the call: a slow disk's synchronous staging).
    gate = records["save-async"]["gate_wait_s"]
    assert records["save-async"]["blocking_s"] == pytest.approx(records["save-async"]["save_s"] + (gate or 0.0))
    assert records["save-sync"]["load_s"] > 0  # the resume from its mid-run checkpoint, timed by the worker
    assert records["fsdpjob"]["planned_peak_mb"] > 0 and records["fsdpjob"]["startup_s"] > 0
    assert not any((tmp_path / "gpu-bench").glob("*")) and "| fsdpjob | " in done.stdout
