"""Chains, webhooks and start estimates on the real dev cluster (Slurm 22.05): `--after` holds the child in
PENDING (Dependency) until its parent completes, and `export --submit` exports after it; a cancelled parent
leaves the child never started, and status says why; a webhook to a local HTTP server gets the run's events in
order from a real run, and its URL is nowhere on disk or in what fsdpjob prints; `plan` and `submit --dry-run`
show the real `sbatch --test-only`'s estimate. The pure parts are in tests/test_chains.py and
tests/test_notify.py."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from helpers import fsdpjob, wait_for
from slurm.slurm_helpers import status, submit, wait_phase
from test_notify import Hook

from fsdpjob.orchestrator.core.runfolder import runlog
from fsdpjob.orchestrator.slurm import commands as slurm_cli

pytestmark = [pytest.mark.slow]


def _files_holding(root: Path, needle: str) -> list[str]:
    found = []
    for path in root.rglob("*"):
        if path.is_file() and not path.is_symlink():
            try:
                if needle.encode() in path.read_bytes():
                    found.append(str(path))
            except OSError:
                pass
    return found


def test_after_holds_the_child_until_the_parent_completes_and_the_webhook_gets_the_events(
        slurm_cluster, make_spec, monkeypatch):
    hook = Hook()
    token = hook.url.rsplit("/", 1)[1]
    monkeypatch.setenv("FSDPJOB_TEST_HOOK", hook.url)  # where the user submits: sbatch passes it to the job
    try:
        parent_spec = make_spec("chain-parent", resources__nodes=1, train__max_steps=6,
                                notify={"webhook_url_env": "FSDPJOB_TEST_HOOK"})
        child_spec = make_spec("chain-child", resources__nodes=1, train__max_steps=6)
        parent = submit(parent_spec)
        child = submit(child_spec, "--after", parent["run_id"])

        out = Path(os.environ["FSDPJOB_HOME"]) / "exported"
        said = fsdpjob("export", parent["run_id"], "--submit", "-p", "test-cluster", "--out", str(out),
                       check=True).stdout
        export_job = said.split(" as job ", 1)[1].split(",", 1)[0]
        assert f"to start after job {parent['job_id']} completes" in said

        held = status(child["run_id"])
        assert (held["phase"], held["reason"]) == ("PENDING", "Dependency"), held
        assert held["after"]["state"] == "waiting" and held["after"]["run_id"] == parent["run_id"]
        assert held["after"]["kind"] == "afterok" and held["after"]["job_id"] == parent["job_id"]
        text = fsdpjob("status", child["run_id"], check=True).stdout
        assert f"after      waiting for parent {parent['run_id']} (job {parent['job_id']}) to complete" in text

        assert wait_phase(parent["run_id"], {"COMPLETED", "FAILED"}, timeout=400)["phase"] == "COMPLETED"
        assert wait_phase(child["run_id"], {"COMPLETED", "FAILED"}, timeout=400)["phase"] == "COMPLETED"
        rows = {r.job_id: r for r in slurm_cli.sacct([parent["job_id"], child["job_id"]])}
        parent_end = slurm_cli.slurm_timestamp(rows[parent["job_id"]].end)
        child_start = slurm_cli.slurm_timestamp(rows[child["job_id"]].start)
        assert child_start >= parent_end, (rows[parent["job_id"]], rows[child["job_id"]])
        assert status(child["run_id"])["after"]["state"] == "released"
        # export --submit: a CPU job after the training, through the same export code path.
        wait_for(lambda: slurm_cli.job_state(export_job) in ("COMPLETED", "FAILED", "CANCELLED"), timeout_s=300,
                 what="the export job")
        assert slurm_cli.job_state(export_job) == "COMPLETED" and (out / "config.json").is_file()
        assert slurm_cli.slurm_timestamp(slurm_cli.sacct([export_job])[0].start) >= parent_end

        # The parent's events, in order, from its supervisor's thread; the child has no notify section.
        got = wait_for(lambda: hook.got if any(p["event"] == "done" for p in hook.got) else None, timeout_s=30,
                       what="the done webhook")
        assert [p["event"] for p in got] == ["start", "done"], got
        assert {p["run"] for p in got} == {parent["run_id"]} and got[-1]["step"] == 6
        assert isinstance(got[-1]["goodput"], float) and 0 < got[-1]["goodput"] <= 1

        # The URL (its token) is in no file of the run folders, the scripts, the logs or the registry, and in
        # nothing status or list print.
        assert _files_holding(Path(os.environ["FSDPJOB_HOME"]), token) == []
        for out in (fsdpjob("status", parent["run_id"], "--json", check=True).stdout,
                    fsdpjob("list", "--json", check=True).stdout,
                    fsdpjob("logs", parent["run_id"], "--stderr", check=True).stdout):
            assert token not in out and "127.0.0.1" not in out
    finally:
        hook.close()


def test_a_cancelled_parent_leaves_the_child_never_started(slurm_cluster, make_spec):
    parent = submit(make_spec("doomed-parent", resources__nodes=1, train__max_steps=6))
    child = submit(make_spec("orphan-child", resources__nodes=1, train__max_steps=6), "--after",
                   f"{parent['job_id']}:ok")  # the parent by its Slurm job id
    fsdpjob("cancel", parent["run_id"], check=True)
    report = wait_for(lambda: (s := status(child["run_id"]))["after"]["state"] == "never" and s, timeout_s=120,
                      what="the child to be reported as never starting")
    assert report["phase"] == "PENDING" and report["reason"] == "DependencyNeverSatisfied"
    said = f"will never start: parent {parent['run_id']} failed (cancelled)"
    assert report["after"]["message"].startswith(said) and report["failure_reason"].startswith(said)
    assert said in fsdpjob("status", child["run_id"], check=True).stdout
    waited = fsdpjob("wait", child["run_id"], timeout_s=120)  # returns instead of waiting for ever
    assert waited.returncode == 1 and said in waited.stderr
    fsdpjob("cancel", child["run_id"], check=True)
    events = [e["event"] for e in runlog.read_events(child["run_dir"])]
    assert report["step"] is None and events == ["cancel"], events  # no worker ever started


def test_plan_and_dry_run_show_slurms_start_estimate(slurm_cluster, make_spec):
    spec = make_spec("estimated", resources__nodes=1, resources__gpus_per_node=2)
    plan = json.loads(fsdpjob("plan", str(spec), "--json", "--shapes", "2x2", check=True).stdout)
    rows = {r["shape"]: r for r in plan["start_estimates"]}
    assert set(rows) == {"1x2", "2x2"} and all(r["error"] is None for r in rows.values()), rows
    assert rows["1x2"]["partition"] == "debug" and rows["2x2"]["nodes"] == "n[1-2]"
    assert slurm_cli.slurm_timestamp(rows["1x2"]["start"]) is not None
    dry = fsdpjob("submit", str(spec), "--dry-run", check=True)
    lines = [ln for ln in dry.stderr.splitlines() if ln.startswith("  1x2 ")]
    assert "start estimate (Slurm's sbatch --test-only" in dry.stderr and len(lines) == 1 and " on n" in lines[0]
    # --test-only submits nothing: Slurm's accounting has no job of that name.
    assert slurm_cli.run(["sacct", "-n", "-X", "-o", "JobID", "--name", "estimated", "-S", "2000-01-01"]).strip() == ""
