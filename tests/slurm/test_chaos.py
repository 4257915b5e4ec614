"""Chaos on the real cluster: one 2x2 FSDP2 run hit by random faults must finish with the bits of an
uninterrupted run. Faults (seeded; the seed is printed): preemption by a high-tier job, the time-limit
warning signal, an external `scontrol requeue`, SIGKILL of one worker rank (a crash: restarted inside the
allocation), SIGSTOP of one (a hang: detected, stacks dumped, restarted inside the allocation), SIGKILL of a
node's slurmd and its restart. FSDPJOB_CHAOS_FAULTS (default 5) and FSDPJOB_CHAOS_SEED set the count and the seed;
FSDPJOB_CHAOS_KINDS (comma-separated) restricts the fault kinds; FSDPJOB_CHAOS_MEMORY_TIER=N turns the memory tier
on (every N steps); FSDPJOB_CHAOS_DURABLE_EVERY=N saves a durable checkpoint every N steps (default 0: the test
spec's stop and final checkpoints only). The summary gives the steps lost per unsignalled fault (crash, hang), which
bench/chaos.sh compares with and without the tier."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time
from pathlib import Path

import pytest
from helpers import fsdpjob, wait_for
from slurm.slurm_helpers import final_weights, release_held, status, submit, wait_phase
from slurm.test_fsdp_slurm import assert_same_weights, preempt_now, status_of, worker_pids

pytestmark = [pytest.mark.chaos, pytest.mark.distributed, pytest.mark.slow]

FAULTS = ("preempt", "time_limit_signal", "scontrol_requeue", "kill_rank", "stop_rank", "kill_slurmd")


def inject(fault: str, job_id: str, run_dir: str, rng: random.Random, cluster) -> None:
    if fault == "preempt":
        preempt_now()
    elif fault == "time_limit_signal":
        # What Slurm sends before the time limit: the warning signal to every task of the job's steps.
        _retry(["scancel", "--signal=USR2", job_id])
    elif fault == "scontrol_requeue":
        _retry(["scontrol", "requeue", job_id])
    elif fault == "kill_rank":
        pids = worker_pids(run_dir)
        if pids:
            os.kill(rng.choice(pids), signal.SIGKILL)
    elif fault == "stop_rank":  # a hang: one rank frozen; the supervisor must notice, dump stacks, restart
        pids = worker_pids(run_dir)
        if pids:
            os.kill(rng.choice(pids), signal.SIGSTOP)
    elif fault == "kill_slurmd":
        from fsdpjob.orchestrator.devcluster import manage

        node = rng.choice(["n1", "n2"])
        pidfile = Path(cluster.state_dir) / "run" / f"slurmd.{node}.pid"
        os.kill(int(pidfile.read_text().split()[0]), signal.SIGKILL)
        time.sleep(rng.uniform(0.5, 3))
        manage.up(accounting=cluster.accounting, state_dir=str(cluster.state_dir))  # restarts the missing slurmd


def _retry(argv: list[str], attempts: int = 40) -> None:
    """Slurm refuses to alter a job in some transitions ("try again later"), or the job went back to the
    queue since it was seen running (an earlier preemption's grace time ran out): the fault then lands a
    moment later, once the job runs again."""
    for _ in range(attempts):
        proc = subprocess.run(argv, capture_output=True, text=True)
        if proc.returncode == 0:
            return
        if "pending" in proc.stderr.lower():
            release_held(argv[-1])  # tests only: skip the 120 s BeginTime hold
        time.sleep(0.5)
    state = subprocess.run(["scontrol", "show", "job", argv[-1]], capture_output=True, text=True).stdout
    raise AssertionError(f"{argv} kept failing: {proc.stderr.strip()} [{' '.join(state.split()[:30])}]")


def running_with_progress(run: dict, past_step: int) -> bool:
    """Back to training after the last fault: RUNNING in Slurm and beyond the step the fault hit."""
    state = status_of(run["job_id"])
    if state == "PENDING":
        release_held(run["job_id"])  # tests only: skip the 120 s BeginTime hold
    report = status(run["run_id"])
    return state == "RUNNING" and (report["step"] or 0) > past_step and worker_pids(run["run_dir"]) != []


def test_random_faults_still_give_the_uninterrupted_bits(slurm_cluster, make_spec, tmp_path_factory):
    count = int(os.environ.get("FSDPJOB_CHAOS_FAULTS", "5"))
    seed = int(os.environ.get("FSDPJOB_CHAOS_SEED", str(random.SystemRandom().randrange(10**6))))
    print(f"chaos seed {seed}, {count} faults")
    rng = random.Random(seed)
    steps = 60 + 25 * count
    # A 10 s stall floor keeps a frozen rank's detection short; every fault may cost a restart in the allocation.
    tier = int(os.environ.get("FSDPJOB_CHAOS_MEMORY_TIER", "0"))
    durable = int(os.environ.get("FSDPJOB_CHAOS_DURABLE_EVERY", "0"))
    tasks = int(os.environ.get("FSDPJOB_CHAOS_TASKS_PER_NODE", "1"))  # bench/chaos.sh: 2
    spec = make_spec(f"chaos{count}" + (f"-tier{tier}" if tier else ""), train__max_steps=steps,
                     resources__gpus_per_node=tasks,
                     preemption__max_requeues=4 * count + 5, recovery__stall_floor_s=10,
                     recovery__max_restarts=count + 1, checkpoint__memory_interval_steps=tier,
                     checkpoint__interval_steps=durable)

    reference = submit(spec)
    assert wait_phase(reference["run_id"], {"COMPLETED", "FAILED"}, timeout=600)["phase"] == "COMPLETED"
    run = submit(spec)
    injected: list[tuple[str, int]] = []
    injected_at: list[float] = []
    # The first fault comes once training has begun (a crash before any step of the first attempt is
    # treated as a setup failure and not requeued, by design); later ones may hit setup too.
    last_step = 0
    for _ in range(count):
        while True:  # a random moment: mid-step, mid-save or mid-setup, of a job that Slurm still runs
            wait_for(lambda: running_with_progress(run, last_step), timeout_s=300, interval_s=1.0,  # noqa: B023
                     what="run back and training")
            time.sleep(rng.uniform(2, 8))
            if status_of(run["job_id"]) in ("RUNNING", "COMPLETED", ""):
                break
        report = status(run["run_id"])
        if report["phase"] == "COMPLETED":
            break
        kinds = [f for f in os.environ.get("FSDPJOB_CHAOS_KINDS", ",".join(FAULTS)).split(",") if f]
        fault = rng.choice(kinds)
        inject(fault, run["job_id"], run["run_dir"], rng, slurm_cluster)
        injected.append((fault, report["step"] or 0))
        injected_at.append(time.time())
        last_step = report["step"] or 0
        print(f"injected {fault} near step {report['step']}")

    def finished() -> dict | None:
        report = status(run["run_id"])
        if status_of(run["job_id"]) == "PENDING":
            release_held(run["job_id"])
        return report if report["phase"] in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT") else None

    done = wait_for(finished, timeout_s=900, interval_s=1.0, what="chaos run to finish")
    summary = {"seed": seed, "faults": injected, "phase": done["phase"], "restarts": done["restarts"],
               "steps_lost": done["steps_lost"]}
    goodput = json.loads(fsdpjob("report", run["run_id"], "--json", check=True).stdout)
    summary["goodput"] = goodput_accuracy(goodput, list(zip(injected, injected_at)), run["run_dir"])
    unsignalled = [c["lost_steps"] for c in goodput["interruptions"] if c["kind"] in ("crash", "hang")]
    summary["memory_tier_every"], summary["durable_every"] = tier, durable
    summary["steps_lost_per_unsignalled_fault"] = (round(sum(unsignalled) / len(unsignalled), 2) if unsignalled
                                                   else None)
    print("chaos summary", json.dumps(summary))
    results = os.environ.get("FSDPJOB_CHAOS_REPORT")
    if results:
        Path(results).write_text(json.dumps(summary))
    assert done["phase"] == "COMPLETED", (summary, done)
    parts = sum(goodput["unit_seconds"].values())
    assert abs(parts - goodput["allocated_unit_s"]) <= 0.02 * goodput["allocated_unit_s"], summary["goodput"]
    assert done["step"] == steps
    assert_same_weights({"weights": final_weights(reference["run_dir"])}, run["run_dir"])


def goodput_accuracy(rep: dict, faults: list[tuple[tuple[str, int], float]], run_dir: str) -> dict:
    """The report's lost time for each SIGKILLed rank against the harness's own account: from the moment the
    attempt had trained the step the next attempt resumed from (its save of that step, or its ready) to the
    kill, less blocking saves in between. Signalled faults should lose nothing."""
    events = [json.loads(x) for x in Path(run_dir, "events.jsonl").read_text().splitlines()]
    readies = [e for e in events if e["event"] == "ready"]
    crashes = [c for c in rep["interruptions"] if c["kind"] in ("crash", "hang")]
    rows = []
    for n, ((fault, step), at) in enumerate(faults):
        row = {"fault": fault, "step": step}
        until = faults[n + 1][1] if n + 1 < len(faults) else float("inf")
        cut = next((c for c in crashes if at - 1 <= c["time"] < until), None)  # the crash this fault caused
        before, after = [r for r in readies if r["time"] < at], [r for r in readies if r["time"] > at]
        if fault == "kill_rank" and cut is not None and before and after:
            saves = [e for e in events if e["event"] == "checkpoint" and before[-1]["time"] <= e["time"] <= at]
            t_kept = next((e["time"] for e in saves if e["step"] == after[0]["step"]), before[-1]["time"])
            blocked = sum(e["save_s"] for e in saves if e["time"] > t_kept)
            row.update(truth_s=round(at - t_kept - blocked, 2), report_s=round(cut["lost_s"], 2))
        elif fault == "kill_rank":
            row.update(report_s=None)  # no crash followed: the kill missed training (setup, a stop, srun)
        rows.append(row)
    return {"allocated_unit_s": rep["allocated_unit_s"], "parts_s": sum(rep["unit_seconds"].values()),
            "step_s": rep["step_s"], "goodput": rep["goodput"], "ettr": rep["ettr"], "seconds": rep["unit_seconds"],
            "interruptions": [(c["kind"], c["step"], c["lost_steps"], round(c["lost_s"], 2))
                              for c in rep["interruptions"]],
            "faults": rows}
