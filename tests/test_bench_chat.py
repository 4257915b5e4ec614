"""bench/chat_throughput.py runs end to end on CPU (--quick): fsdpjob's default spec and the TRL and HF Trainer
baselines train on the same chat file, each on FSDP2, and every case's real tokens per step are counted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import chat_throughput  # noqa: E402 - bench/ is no package


def test_chat_lengths_are_long_tailed_seeded_and_clipped():
    lengths = chat_throughput.chat_lengths(4000, 512, seed=3)
    assert lengths == chat_throughput.chat_lengths(4000, 512, seed=3)
    assert min(lengths) >= 16 and max(lengths) == 512  # clipped at seq_len: the tail reaches it
    mean, median = sum(lengths) / len(lengths), sorted(lengths)[len(lengths) // 2]
    assert mean > 1.3 * median  # log-normal: the mean well above the median


@pytest.mark.slow
@pytest.mark.distributed
def test_chat_bench_quick_runs_every_kind_of_case(tmp_path: Path) -> None:
    # trl-padding-free differs from trl-packing by two SFTConfig fields only: left out to keep the test short.
    cases = ["fsdpjob", "trl-packing", "hf-padding"]
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "chat_throughput.py"), "--quick", "--cases", *cases,
         "--workdir", str(tmp_path / "work"), "--json", str(tmp_path / "out.json")],
        capture_output=True, text=True, timeout=600, env=dict(os.environ, HF_HUB_OFFLINE="1"),
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    saved = json.loads((tmp_path / "out.json").read_text())
    results = {r["case"]: r for r in saved["results"]}
    assert set(results) == set(cases)
    for r in results.values():
        assert r["error"] is None and r["rate"] > 0 and r["cpu_rate"] > 0, r
    # Matched real tokens per step: the packed rows' fill and the unpacked batches' examples agree within 25 %
    # (the unpacked ones vary with the lengths drawn; 2 timed steps here).
    reals = [r["real_per_step"] for r in results.values()]
    assert max(reals) < 1.25 * min(reals), reals
    assert results["hf-padding"]["positions_per_step"] > results["hf-padding"]["real_per_step"]  # it pads
    assert results["fsdpjob"]["info"]["packing_efficiency"] == pytest.approx(saved["shape"]["fill"], abs=0.01)
    for case in ("trl-packing", "hf-padding"):  # FSDP2 really ran, not DDP
        info = results[case]["info"]
        assert info["dtensor_params"] == info["param_tensors"] > 0 and "FSDP" in info["accelerate_distributed_type"]
    assert "fsdpjob / trl-packing:" in done.stdout and "fsdpjob / hf-padding:" in done.stdout
