"""`fsdpjob submit` runs the planner first: a job that cannot fit is refused (exit 2, plan printed, nothing
written) unless --force; --dry-run prints the plan and the script and touches nothing."""

from __future__ import annotations

import json
import os
from pathlib import Path

from helpers import fsdpjob
from specs import llama2_70b_spec


def test_submit_refuses_a_job_that_cannot_fit(tmp_path):
    spec = llama2_70b_spec(tmp_path, nodes=1)
    proc = fsdpjob("submit", str(spec), cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "DOES NOT FIT" in proc.stderr
    assert "fsdp.cpu_offload=true" in proc.stderr and "resources.nodes=3" in proc.stderr
    home = Path(os.environ["FSDPJOB_HOME"])
    assert not (home / "registry").exists() and not (home / "runs").exists()


def test_plan_for_the_seed_case_fits_on_three_nodes(tmp_path):
    proc = fsdpjob("plan", str(llama2_70b_spec(tmp_path, nodes=3)), "--json", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["fits"] is True


def test_dry_run_prints_plan_and_script_and_touches_nothing(tmp_path):
    proc = fsdpjob("submit", str(llama2_70b_spec(tmp_path, nodes=3)), "--dry-run", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("#!/bin/bash") and "#SBATCH --nodes=3" in proc.stdout
    assert "FITS" in proc.stderr
    home = Path(os.environ["FSDPJOB_HOME"])
    assert not (home / "registry").exists() and not (home / "runs").exists()
