"""Chains (`submit --after`, `export --submit`) and start estimates (`sbatch --test-only`) without a cluster:
parsing, rendering (a golden export script), the chain's status, bad input. The real cluster's side is in
tests/slurm/test_chains_slurm.py."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from helpers import fsdpjob, tiny_model_folder
from test_render import PYTHON, assert_golden, render

from fsdpjob.orchestrator.cli.chain import parse_after
from fsdpjob.orchestrator.cli.estimate import estimate, format_estimates, parse_shapes, parse_test_only
from fsdpjob.orchestrator.core.errors import InputError
from fsdpjob.orchestrator.core.jobspec.profiles import load_profile
from fsdpjob.orchestrator.slurm.exportscript import build_export_plan, render_export
from fsdpjob.orchestrator.views.chains import chain_state

TESTS = Path(__file__).resolve().parent
RECORDED = TESTS / "data" / "slurm-22.05"
VALID = TESTS / "data" / "specs" / "valid"


@pytest.mark.parametrize("text, expected", [
    ("my-run", ("my-run", "afterok")), ("my-run:ok", ("my-run", "afterok")), ("1234:any", ("1234", "afterany")),
    ("run-2026.x_1:ok", ("run-2026.x_1", "afterok")),
])
def test_after_takes_a_run_and_a_condition(text, expected):
    assert parse_after(text) == expected


@pytest.mark.parametrize("text, said", [
    ("my-run:done", "unknown condition 'done'"), ("my-run:", "is not RUN[:ok|any]"), ("", "the value is empty"),
    (" ", "the value is empty"),
    ("a b", "is not RUN[:ok|any]"), ("a:ok:any", "is not RUN[:ok|any]"),
])
def test_bad_after_is_one_line_naming_the_option(text, said):
    with pytest.raises(InputError) as err:
        parse_after(text)
    assert said in err.value.format() and err.value.format().startswith("--after: ")


def test_bad_after_on_the_command_line_exits_2_before_anything_is_submitted(tmp_path):
    home = {"FSDPJOB_HOME": str(tmp_path)}
    spec = str(VALID / "single-node.yaml")
    done = fsdpjob("submit", spec, "--after", "x:sometimes", "--dry-run", "--no-file-checks", env=home)
    assert done.returncode == 2 and "--after: 'x:sometimes': unknown condition" in done.stderr
    done = fsdpjob("submit", spec, "--after", "", "--dry-run", "--no-file-checks", env=home)
    assert done.returncode == 2 and done.stderr.startswith("--after: the value is empty"), done.stderr
    assert len(done.stderr.splitlines()) == 1
    done = fsdpjob("submit", spec, "--after", "no-such-run", "--dry-run", "--no-file-checks", env=home)
    assert done.returncode == 2 and "--after: no run 'no-such-run' in the registry" in done.stderr
    done = fsdpjob("submit", spec, "--after", "x", "--dry-run", "--no-file-checks", "-p", "local", env=home)
    assert done.returncode == 2 and "--after: the local scheduler does not support chains" in done.stderr
    assert not (tmp_path / "runs").exists()


def test_the_dependency_is_rendered_as_a_directive(monkeypatch):
    from dataclasses import replace

    from fsdpjob.orchestrator.core.runfolder.paths import RunPaths
    from fsdpjob.orchestrator.planner.jobload import load_job
    from fsdpjob.orchestrator.slurm.backend import BACKEND

    monkeypatch.setattr(sys, "executable", PYTHON)
    job = load_job(str(VALID / "single-node.yaml"), check_files=False)
    plain = BACKEND.dry_run(job, RunPaths(Path("/runs/x"))).script
    chained = BACKEND.dry_run(replace(job, dependency="afterany:42"), RunPaths(Path("/runs/x"))).script
    assert "--dependency" not in plain
    assert [ln for ln in chained.splitlines() if ln not in plain.splitlines()] == ["#SBATCH --dependency=afterany:42"]


AFTER = {"run_id": "parent-1", "job_id": "41", "kind": "afterok"}


@pytest.mark.parametrize("state, reason, started, parent, expected", [
    ("PENDING", "Dependency", False, "RUNNING", "waiting"),
    ("PENDING", "DependencyNeverSatisfied", False, "FAILED", "never"),  # Slurm's default: pending for ever
    ("PENDING", "DependencyNeverSatisfied", False, None, "never"),  # the parent aged out of the registry
    ("CANCELLED", "DependencyNeverSatisfied", False, "FAILED", "never"),  # kill_invalid_depend
    ("CANCELLED", None, False, "CANCELLED", "never"),  # kill_invalid_depend seen through sacct (no reason)
    ("CANCELLED", None, True, "FAILED", "released"),  # it ran, and was cancelled itself
    ("PENDING", "Priority", False, "COMPLETED", "released"),
    ("PENDING", None, False, None, "waiting"),  # sacct's view (list): no reason
    ("RUNNING", None, True, None, "released"),
])
def test_the_chain_state_from_the_scheduler_and_the_parent(state, reason, started, parent, expected):
    got = chain_state(AFTER, state, reason, started, parent)
    assert got["state"] == expected and got["run_id"] == "parent-1"
    if expected == "never":
        assert got["message"].startswith("will never start: parent parent-1 failed")


def test_an_afterany_child_of_a_failed_parent_still_starts():
    assert chain_state({**AFTER, "kind": "afterany"}, "CANCELLED", None, False, "FAILED")["state"] == "released"


def test_export_job_script_golden(monkeypatch):
    profile = load_profile("test-cluster")
    plan = build_export_plan(run_id="lora-20261203-120000-abcd", run_dir="/runs/lora-20261203-120000-abcd",
                             job_id="41", name="lora", profile=profile.model_copy(update={"python": PYTHON}),
                             out="/exports/lora's model", dtype="bf16", merge=True,
                             log="/runs/lora-20261203-120000-abcd/exports/export-%j.out")
    text = render_export(plan)
    assert_golden("export.sbatch", text)
    assert "#SBATCH --dependency=afterok:41" in text and "gpus" not in text


def test_export_submit_needs_a_profile_and_a_slurm_one(tmp_path):
    home = {"FSDPJOB_HOME": str(tmp_path)}
    done = fsdpjob("export", "some-run", "--out", str(tmp_path / "o"), "--submit", env=home)
    assert done.returncode == 2 and "--submit needs --profile" in done.stderr
    done = fsdpjob("export", "some-run", "--out", str(tmp_path / "o"), "-p", "test-cluster", env=home)
    assert done.returncode == 2 and "--profile goes with --submit" in done.stderr


def test_recorded_test_only_22_05():
    """Recorded on the dev cluster (Slurm 22.05.8): the job waits for a running one, or would preempt it."""
    waits = parse_test_only((RECORDED / "sbatch-test-only.txt").read_text())
    assert (waits.start, waits.cpus, waits.nodes, waits.partition) == ("2026-12-03T14:31:50", 2, "n[1-2]", "debug")
    assert waits.start_ts is not None
    preempts = parse_test_only((RECORDED / "sbatch-test-only-preempts.txt").read_text())
    assert (preempts.start, preempts.partition) == ("2026-12-03T13:54:38", "high")
    relative = parse_test_only((RECORDED / "sbatch-test-only-relative.txt").read_text())  # SLURM_TIME_FORMAT
    assert relative.start == "14:31:50" and relative.start_ts is None


@pytest.mark.parametrize("text, start, partition", [
    # From sbatch.c's format strings (not recorded here): newer slurmctlds print the job_submit plugin's
    # message first; slurmctld 17.11 and older named no partition; a relative time has spaces.
    ("sbatch: Your job will run on the gpu partition\nsbatch: Job 881 to start at 2027-01-05T09:00:00 using 64 "
     "processors on nodes gpu[01-04] in partition gpu\nsbatch:   Preempts: 870,871\n", "2027-01-05T09:00:00", "gpu"),
    ("sbatch: Job 12 to start at 2027-01-05T09:00:00 using 8 processors on nodes a1\n", "2027-01-05T09:00:00", None),
    ("sbatch: Job 12 to start at Tomorr 09:00 using 8 processors on nodes a1 in partition p\n", "Tomorr 09:00", "p"),
])
def test_newer_and_older_test_only_lines(text, start, partition):
    got = parse_test_only(text)
    assert (got.start, got.partition) == (start, partition)


def test_no_estimate_line_is_none():
    assert parse_test_only("sbatch: error: Batch job submission failed: Invalid partition name specified") is None


def test_shapes_and_bad_shapes():
    assert parse_shapes("2x8,4x8") == [(2, 8), (4, 8)]
    for bad in ("2*8", "0x8", "2x", "x8", "2x8,,4x8"):
        with pytest.raises(InputError, match="--shapes: .* is not a shape"):
            parse_shapes(bad)


def test_estimates_mark_which_finishes_first():
    answers = {"A": "sbatch: Job 1 to start at 2027-01-05T12:00:00 using 16 processors on nodes a[1-2] in partition p",
               "B": "sbatch: Job 2 to start at 2027-01-05T09:00:00 using 32 processors on nodes a[1-4] in partition p"}
    rows = [estimate("2x8", "A", 2.0, 3600, answers.get), estimate("4x8", "B", 1.1, 3600, answers.get)]
    assert rows[0]["total_s"] == 7200 and rows[1]["finish"] == "2027-01-05T10:06:00"
    lines = format_estimates(rows)
    assert "finishes first" in lines[2] and "finishes first" not in lines[1]


def test_no_slurm_is_one_line_not_a_failure(tmp_path):
    model = tiny_model_folder(tmp_path / "model")
    (model / "config.json").write_text(json.dumps({  # what the planner sizes the model from
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "max_position_embeddings": 256, "hidden_size": 64,
        "num_attention_heads": 4, "num_hidden_layers": 2, "intermediate_size": 128, "vocab_size": 256}))
    done = fsdpjob("plan", str(VALID / "single-node.yaml"), "--set", f"model.path={model}", "--set", "data.seq_len=128",
                   env={"PATH": str(tmp_path), "FSDPJOB_HOME": str(tmp_path)})
    assert done.returncode == 0, done.stderr
    assert done.stdout.rstrip().endswith("verdict: FITS")  # the plan; the estimate is beside it, on stderr
    estimate_lines = [ln for ln in done.stderr.splitlines() if ln.startswith("start estimate")]
    assert estimate_lines == ["start estimate: none (sbatch not found on PATH: is this a Slurm login node?)"]


def test_mail_is_rendered_for_the_events_slurm_knows(monkeypatch, tmp_path):
    script = render(VALID / "single-node.yaml", monkeypatch, overrides=(
        "notify.mail=me@example.org", "notify.events=[start, fault, done]"))
    assert "#SBATCH --mail-type=BEGIN,END" in script and "#SBATCH --mail-user=me@example.org" in script
    assert "mail" not in render(VALID / "single-node.yaml", monkeypatch)
