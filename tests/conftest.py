"""Shared fixtures: tiny spec files, hostile strings, an isolated FSDPJOB_HOME."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
sys.path.insert(0, str(TESTS))  # for `from distributed import run_ranks`


@pytest.fixture(autouse=True)
def _isolated_home(tmp_path_factory, monkeypatch):
    """Every test gets its own registry so tests never see the user's jobs or each other's."""
    home = tmp_path_factory.mktemp("fsdpjob_home")
    monkeypatch.setenv("FSDPJOB_HOME", str(home))
    monkeypatch.delenv("FSDPJOB_PROFILES", raising=False)
    return home
