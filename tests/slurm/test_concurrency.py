"""Concurrency on the real dev cluster: 50 `fsdpjob submit` at once give 50 Slurm jobs and 50 registry records while
list, status and a registry reader run in loops without a failure (bench/concurrency.py prints the figures)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from concurrency import cancel_all, held_spec, squeue_ids, storm

from fsdpjob.orchestrator import submit
from fsdpjob.orchestrator.core.errors import InputError

SUBMITS = 50


def test_fifty_concurrent_submits_lose_nothing(
    slurm_cluster, assets: dict, tmp_path: Path, _isolated_home: Path
) -> None:
    result = storm(held_spec(tmp_path, assets), SUBMITS, _isolated_home)
    try:
        summary = result.summary()
        print(summary)
        assert result.submit_failures == [], result.submit_failures[:3]
        assert len(set(result.job_ids)) == SUBMITS and len(set(result.run_ids)) == SUBMITS
        assert set(result.job_ids) <= squeue_ids(), "a reported job is not in the Slurm queue"
        assert result.records == SUBMITS and result.lost == []
        assert result.failures == {"list": [], "status": [], "registry reads": []}
        assert min(result.calls.values()) >= 2, result.calls  # the loops really ran alongside the submits
    finally:
        cancel_all(result.job_ids)


def test_two_submits_drawing_the_same_run_id_get_two_folders(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Run ids of one name in one second differ by 2 random bytes; mkdir decides who gets one, the other redraws."""
    ids = iter(["job-1", "job-1", "job-2"])
    monkeypatch.setattr(submit, "new_run_id", lambda name: next(ids))
    monkeypatch.setattr(submit, "runs_root", lambda: tmp_path)
    first, second = submit._claim_run_folder("job", None), submit._claim_run_folder("job", None)
    assert (first.run_id, second.run_id) == ("job-1", "job-2") and first.run_dir.is_dir() and second.run_dir.is_dir()
    with pytest.raises(InputError, match="already exists; pick another"):  # a usage error: exit 2
        submit._claim_run_folder("job", tmp_path / "job-1")
