"""Issue 12 on the real dev cluster (2 nodes x 1 task; 2 x 2 where a fault is told from a peer on its node):
hangs are detected by the in-allocation supervisor, every rank's stacks are dumped, and the workers restart in the
same allocation (same Slurm job id, no requeue); the run ends COMPLETED with the final weights of the uninterrupted
run. SIGKILLed ranks (issue 12's crash case) are in
test_hang_before_a_save_then_crashes_on_either_node_stay_in_the_allocation."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest
from helpers import fsdpjob, wait_for
from slurm.slurm_helpers import in_its_own_container, status, submit, wait_phase
from slurm.test_fsdp_slurm import assert_same_weights

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

# Checkpoints every 5 steps (the math is the reference's); short bounds keep the test short.
FAST = ("--set", "checkpoint.interval_steps=5", "--set", "recovery.stall_floor_s=5",
        "--set", "recovery.setup_timeout_s=120")


def _events(run_dir: str) -> list[dict]:
    return [json.loads(x) for x in Path(run_dir, "events.jsonl").read_text().splitlines()]


def _finished(run: dict) -> dict:
    done = wait_phase(run["run_id"], {"COMPLETED", "FAILED", "CANCELLED"}, timeout=420)
    assert done["phase"] == "COMPLETED" and done["restarts"] == 0, done
    return done


def _one_allocation(run: dict, launches: int) -> list[dict]:
    events = _events(run["run_dir"])
    assert not [e for e in events if e["event"] in ("requeue", "failed") and "rank" not in e], events
    starts = [e for e in events if e["event"] == "start"]
    assert [(e["job_id"], e["restart"], e["launch"]) for e in starts] == [
        (run["job_id"], 0, n) for n in range(launches)], starts
    return [e for e in events if e["event"] == "fault"]


def test_rank_stuck_in_data_then_a_frozen_rank(slurm_cluster, reference, in_container):
    # In the test image (issue 23): the stacks of the stuck and the frozen rank are taken from outside, by the
    # host pid their heartbeats name (the image shares the host's PID namespace, as enroot and Apptainer do).
    run = submit(reference["spec"], *FAST, "--set", "env.FSDPJOB_FAULT_DATA_HANG_STEP='12'",
                 "--set", "env.FSDPJOB_FAULT_DATA_HANG_RANK='0'", *in_container)
    # Launch 0: rank 0 (node 1) never gets its batch for step 13; the supervisor ends the step, restarts.
    wait_for(lambda: (status(run["run_id"])["recovery"] or {}).get("restarts") == 1, timeout_s=240, interval_s=1.0,
             what="the first restart")
    wait_for(lambda: (status(run["run_id"])["step"] or 0) >= 25, timeout_s=240, interval_s=1.0, what="step 25")
    # Launch 1: rank 1 (node 2) frozen by SIGSTOP.
    beat = json.loads(Path(run["run_dir"], "heartbeat", "rank-1.json").read_text())
    assert beat["launch"] == 1 and in_its_own_container(beat["pid"]), beat
    os.kill(beat["pid"], signal.SIGSTOP)
    done = _finished(run)
    straggler, hang = _one_allocation(run, launches=3)
    assert straggler["kind"] == "straggler" and straggler["ranks"] == [0] and straggler["hosts"] == ["n1"], straggler
    assert "maybe_hang_in_data" in straggler["top_frames"]["0"], straggler["top_frames"]
    assert hang["kind"] == "hang" and hang["ranks"] == [1] and hang["hosts"] == ["n2"], hang
    assert "frozen" in hang["reason"] and hang["detected_after_s"] < 60, hang
    assert len(list(Path(hang["stacks"]).glob("rank-*.txt"))) == 2
    assert done["recovery"]["restarts"] == 2 and done["recovery"]["last_fault"]["kind"] == "hang", done["recovery"]
    shown = fsdpjob("logs", run["run_id"], "--stacks", check=True).stdout
    assert "rank 1" in shown and "frozen" in shown, shown
    assert_same_weights(reference, run["run_dir"])


def test_rank_stuck_in_a_save(slurm_cluster, reference):
    run = submit(reference["spec"], *FAST, "--set", "env.FSDPJOB_FAULT_SAVE_PAUSE_S='100000'",
                 "--set", "env.FSDPJOB_FAULT_SAVE_RANK='1'", "--set", "env.FSDPJOB_FAULT_SAVE_STEP='10'")
    _finished(run)
    [fault] = _one_allocation(run, launches=2)
    assert fault["kind"] == "hang" and fault["step"] == 5, fault  # resumed from the save before the stuck one
    assert any("pausing" in open(p).read() or "write_data" in open(p).read()
               for p in Path(fault["stacks"]).glob("rank-1.txt")), fault
    assert "save" in fault["reason"], fault
    # The first save took well under a second (never seen in progress): the ranks' own figure bounds the
    # stuck one at 4 x the stall floor (20 s), not at the setup bound (120 s).
    assert fault["detected_after_s"] < 60, fault
    assert_same_weights(reference, run["run_dir"])


def test_lost_node_goes_on_with_the_nodes_left(slurm_cluster, reference, in_container):
    """slurmd and the tasks of node 2 killed; with resources.min_nodes 1 the supervisor goes on with node 1
    alone (1 rank, the global batch kept by gradient accumulation), in the same allocation. In the test image
    (issue 23): the probes and the exclusion run outside it."""
    import torch
    from slurm.slurm_helpers import final_weights

    from fsdpjob.orchestrator.devcluster import manage

    run = submit(reference["spec"], *FAST, "--set", "resources.min_nodes=1", *in_container)
    wait_for(lambda: (status(run["run_id"])["step"] or 0) >= 12, timeout_s=240, interval_s=1.0, what="step 12")
    pidfile = Path(slurm_cluster.state_dir) / "run" / "slurmd.n2.pid"
    os.kill(int(pidfile.read_text().split()[0]), signal.SIGKILL)
    os.kill(json.loads(Path(run["run_dir"], "heartbeat", "rank-1.json").read_text())["pid"], signal.SIGKILL)
    try:
        wait_for(lambda: (status(run["run_id"])["recovery"] or {}).get("restarts") == 1, timeout_s=180,
                 interval_s=1.0, what="the restart without n2")
    finally:
        # slurmd n2 back (the job could not finish COMPLETING without it); it stays excluded in this allocation.
        manage.up(accounting=slurm_cluster.accounting, state_dir=str(slurm_cluster.state_dir))
    _finished(run)
    [fault] = _one_allocation(run, launches=2)
    assert fault["kind"] == "crash" and fault["exclude"] == ["n2"] and fault["restart"] is True, fault
    resumes = [e for e in _events(run["run_dir"]) if e["event"] == "resume"]
    assert resumes[-1]["world_size"] == 1 and resumes[-1]["grad_accum_steps"] == 2, resumes
    assert status(run["run_id"])["recovery"]["excluded_nodes"] == ["n2"]
    a, b = reference["weights"], final_weights(run["run_dir"])
    assert all(torch.allclose(a[k], b[k], rtol=1e-3, atol=1e-5) for k in a), "beyond fp32 tolerance"


def _beat(run_dir: str, rank: int) -> dict:
    try:
        return json.loads(Path(run_dir, "heartbeat", f"rank-{rank}.json").read_text())
    except (OSError, ValueError):
        return {}


def _kill_at(run: dict, launch: int, step: int, rank: int) -> None:
    """SIGKILL ``rank`` once launch ``launch`` trained past ``step`` (its heartbeat says so)."""
    wait_for(lambda: (b := _beat(run["run_dir"], rank)).get("launch") == launch and b.get("step", 0) >= step,
             timeout_s=240, interval_s=0.5, what=f"launch {launch} at step {step}")
    os.kill(_beat(run["run_dir"], rank)["pid"], signal.SIGKILL)


def test_hang_before_a_save_then_crashes_on_either_node_stay_in_the_allocation(slurm_cluster, reference_2x2,
                                                                               in_container):
    """Issues 12 and 29, in the test image (issue 23: the supervisor outside sees a rank's death by its host pid),
    at 2 nodes x 2 tasks: each victim has a peer on its own node, which the blame must not name.
    Launch 0: rank 3 (n2) freezes itself (SIGSTOP) after step 10, while the others go into step 10's save: a
    hang detected within the stall floor + 10 s, not after the save's bound. Launch 1: rank 1 (n1) is killed
    (no handler, no checkpoint); its peers fail with connection errors, and only n1 is blamed. Launch 2: rank 2 (n2) is
    killed; n2 is now blamed twice, but the partition has no node to requeue onto without it, so the workers
    restart here again. One allocation, no requeue, the uninterrupted run's bits."""
    run = submit(reference_2x2["spec"], *FAST, "--set", "env.FSDPJOB_FAULT_STOP_STEP='10'",
                 "--set", "env.FSDPJOB_FAULT_STOP_RANK='3'", *in_container)
    _kill_at(run, launch=1, step=17, rank=1)  # checkpoint 15 committed: every restart made progress
    _kill_at(run, launch=2, step=22, rank=2)
    done = _finished(run)
    assert done["recovery"]["restarts"] == 3 and done["recovery"]["last_fault"]["kind"] == "crash", done["recovery"]
    hang, other_node, same_node = _one_allocation(run, launches=4)
    assert hang["kind"] == "hang" and hang["ranks"] == [3] and hang["hosts"] == ["n2"], hang
    # The frozen-process rule fired, not the save's bound; the hook beats once before it freezes (jobs/hooks.py), so
    # the reason names the exact phase and step (the heartbeat's step: 9 steps done when step 10's training began).
    assert "rank 3 on n2 frozen in 'training step' at step 9 (" in hang["reason"], hang
    assert hang["detected_after_s"] <= 5 + 10, hang
    # Rank 1 alone is blamed: its task's shell recorded its end before srun tore anyone down (taskexit.py).
    assert other_node["kind"] == "crash" and other_node["ranks"] == [1] and other_node["hosts"] == ["n1"], \
        json.dumps(other_node)
    assert 1 not in other_node["casualties"] and other_node["restart"] is True, other_node
    assert same_node["ranks"] == [2] and same_node["hosts"] == ["n2"] and same_node["restart"] is True, same_node
    assert "could not exclude" in same_node["decision"], same_node
    assert_same_weights(reference_2x2, run["run_dir"])


def test_a_crash_past_the_restart_budget_is_requeued_by_the_failure_policy_and_resumes(slurm_cluster, reference,
                                                                                      in_container):
    """Issue 23 (the failure policy's requeue on the real cluster, the workers in the test image). No restart is
    allowed in the allocation (recovery.max_restarts 0): rank 1, SIGKILLed after step 12, ends the attempt. The
    batch script's failure policy, outside the container, sees that the attempt trained and runs the one
    `scontrol requeue` (Slurm's restart count 1, a REQUEUED record in sacct); the next allocation resumes from
    the newest committed checkpoint and completes with the uninterrupted run's bits."""
    # FAST's 5 s stall floor is left out: with no restart allowed, a slow step of a loaded machine taken for a
    # hang would end the run before the kill (seen here at a load average of 24).
    run = submit(reference["spec"], "--set", "checkpoint.interval_steps=5", "--set", "recovery.max_restarts=0",
                 *in_container)
    wait_for(lambda: (b := _beat(run["run_dir"], 1)).get("launch") == 0 and b.get("step", 0) >= 12,
             timeout_s=480, interval_s=0.5, what="step 12")
    beat = _beat(run["run_dir"], 1)
    assert in_its_own_container(beat["pid"]), beat  # no scontrol in its root: the requeue runs outside
    os.kill(beat["pid"], signal.SIGKILL)
    queued = wait_phase(run["run_id"], {"REQUEUED", "COMPLETED", "FAILED", "CANCELLED"}, timeout=180)
    assert (queued["phase"] == "REQUEUED"
            and "restart budget spent" in queued["recovery"]["last_fault"]["decision"]), queued

    # Slurm's own 120 s BeginTime hold runs out here (other tests release it at once): released early, the new
    # allocation's tasks on n2 were SIGKILLed ~60 s after the requeue, as slurmctld's messages to that node timed
    # out on a loaded machine (seen 3 times in a row, load average 24); the product never releases it.
    done = wait_phase(run["run_id"], {"COMPLETED", "FAILED", "CANCELLED"}, timeout=600)
    events = _events(run["run_dir"])
    assert done["phase"] == "COMPLETED" and done["step"] == 60 and done["restarts"] == 1, done
    requeues = [e for e in events if e["event"] == "requeue"]
    starts = [(e["job_id"], e["restart"], e["launch"]) for e in events if e["event"] == "start"]
    assert len(requeues) == 1 and starts == [(run["job_id"], 0, 0), (run["job_id"], 1, 0)], (requeues, starts)
    fault = next(e for e in events if e["event"] == "fault")
    assert fault["kind"] == "crash" and fault["restart"] is False and fault["ranks"] == [1], fault
    assert requeues[0]["reason"] == "failure" and requeues[0]["step"] >= 12, requeues
    assert requeues[0]["detail"].startswith("a crash after training progressed"), requeues
    at = events.index(requeues[0])
    resume = next(e for e in events[at:] if e["event"] == "resume")
    saved = [e["step"] for e in events[:at] if e["event"] == "checkpoint"]
    assert resume["step"] >= 10 and resume["step"] in saved, (resume, saved)
    # Slurm's own record of the requeue: the attempts' accounting rows, and the job's restart count.
    rows = subprocess.run(["sacct", "-j", run["job_id"], "-D", "-X", "-n", "-P", "-o", "State"], capture_output=True,
                          text=True, check=True).stdout.split()
    assert rows == ["REQUEUED", "COMPLETED"], rows
    shown = subprocess.run(["scontrol", "show", "job", run["job_id"]], capture_output=True, text=True).stdout
    assert "Restarts=1" in shown or not shown, shown  # slurmctld may have aged the job out
    rep = json.loads(fsdpjob("report", run["run_id"], "--json", check=True).stdout)
    [cut] = rep["interruptions"]
    assert (cut["kind"] == "crash"
            and cut["recovered"] == f"requeued by the failure policy, resumed from step {resume['step']}"), cut
    assert_same_weights(reference, run["run_dir"])


def _task_shell(worker_pid: int) -> int:
    """The pid of the Slurm task's shell (core/runfolder/taskexit.py) that runs the worker ``worker_pid``."""
    from fsdpjob.orchestrator.core.runfolder.taskexit import SHELL_NAME

    ppid = int(next(line.split()[1] for line in Path(f"/proc/{worker_pid}/status").read_text().splitlines()
                    if line.startswith("PPid:")))
    assert SHELL_NAME in Path(f"/proc/{ppid}/cmdline").read_bytes().decode(errors="replace"), ppid
    return ppid


def test_a_sigterm_from_sruns_teardown_restarts_in_the_allocation(slurm_cluster, reference):
    """Issue 55: rank 1's task shell SIGKILLed mid-run; srun tears the step down with SIGTERM to every task; the
    ranks save a stop checkpoint and hand it over. No signal reached the batch step, so the supervisor reads it as
    srun's teardown (not a time limit: no requeue, no ~2 min in Slurm's hold) and restarts the workers in the
    allocation; the run ends COMPLETED with the uninterrupted run's weights."""
    run = submit(reference["spec"], *FAST)
    wait_for(lambda: (status(run["run_id"])["step"] or 0) >= 8, timeout_s=240, interval_s=1.0, what="step 8")
    beat = json.loads(Path(run["run_dir"], "heartbeat", "rank-1.json").read_text())
    os.kill(_task_shell(beat["pid"]), signal.SIGKILL)
    _finished(run)
    events = _events(run["run_dir"])
    [stop] = [e for e in events if e["event"] == "stop"]
    assert (stop["reason"], stop["requeued"], stop.get("restarted")) == ("teardown", False, True), stop
    starts = [e for e in events if e["event"] == "start"]
    assert [(e["job_id"], e["restart"], e["launch"]) for e in starts] == [(run["job_id"], 0, 0), (run["job_id"], 0, 1)]
    assert not [e for e in events if e["event"] == "requeue"], events
    assert_same_weights(reference, run["run_dir"])
