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


def test_a_stray_test_hook_in_the_shell_is_refused_at_submit(tmp_path):
    """sbatch exports the submitting shell: FSDPJOB_SKIP_FINAL_SAVE=1 left there from a benchmark would drop the
    user's final checkpoint unseen. Refused in one line (exit 2, nothing written) unless FSDPJOB_TEST_HOOKS=1 says
    it is on purpose; hooks in the spec's own env are written down and pass."""
    spec = llama2_70b_spec(tmp_path, nodes=3)
    home = Path(os.environ["FSDPJOB_HOME"])
    for command in (("submit", str(spec)), ("submit", str(spec), "--dry-run"), ("validate", str(spec))):
        proc = fsdpjob(*command, cwd=tmp_path, env={"FSDPJOB_SKIP_FINAL_SAVE": "1", "FSDPJOB_FAULT_EXIT_STEP": "3"})
        assert proc.returncode == 2, proc.stderr
        line = proc.stderr.strip().splitlines()[-1]
        assert line.startswith("environment: FSDPJOB_FAULT_EXIT_STEP=3, FSDPJOB_SKIP_FINAL_SAVE=1 set in this shell")
        assert "FSDPJOB_TEST_HOOKS=1" in line
    assert not (home / "registry").exists() and not (home / "runs").exists()
    on_purpose = fsdpjob("submit", str(spec), "--dry-run", cwd=tmp_path,
                         env={"FSDPJOB_SKIP_FINAL_SAVE": "1", "FSDPJOB_TEST_HOOKS": "1"})
    assert on_purpose.returncode == 0, on_purpose.stderr
    in_spec = fsdpjob("submit", str(spec), "--dry-run", "--set", "env.FSDPJOB_MIN_STEP_S='1'", cwd=tmp_path)
    assert in_spec.returncode == 0, in_spec.stderr
