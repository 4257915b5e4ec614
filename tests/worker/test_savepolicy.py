"""The save policy (which steps get a checkpoint, and the last-step rule) and the worker's environment readers."""

from __future__ import annotations

import pytest

from fsdpjob.jobs.hooks import TestHooks
from fsdpjob.jobs.savepolicy import SavePolicy
from fsdpjob.jobs.workerenv import WorkerEnv

POLICY = SavePolicy(interval_steps=4, interval_minutes=0, max_steps=10)


@pytest.mark.parametrize("step, signum, time_due, reason", [
    (1, 0, False, None),
    (4, 0, False, "interval"),
    (8, 0, False, "interval"),
    (3, 0, True, "interval"),
    (10, 0, True, "interval"),  # the final save then finds the step saved and writes nothing
    (3, 12, False, "stop"),
    (4, 12, True, "stop"),
    (10, 12, True, None),  # a stop signal after the last step: the final save, not a requeue
])
def test_reason(step, signum, time_due, reason):
    assert POLICY.reason(step, signum=signum, time_due=time_due) == reason


def test_last_step_is_never_an_interval_save():
    assert SavePolicy(interval_steps=5, interval_minutes=0, max_steps=10).reason(10, signum=0, time_due=False) is None


def test_time_due_only_with_an_interval_in_minutes():
    assert not POLICY.time_due(1e9)
    minutes = SavePolicy(interval_steps=0, interval_minutes=2, max_steps=10)
    assert not minutes.time_due(119.9) and minutes.time_due(120)


def test_hooks_are_off_unless_set(monkeypatch):
    for name in ("STOP_AT_STEP", "LOG_SAMPLES", "FAULT_SAVE_PAUSE_S", "FAULT_SAVE_RANK", "FAULT_SAVE_STEP"):
        monkeypatch.delenv(f"FSDPJOB_{name}", raising=False)
    assert TestHooks.from_env() == TestHooks()
    monkeypatch.setenv("FSDPJOB_STOP_AT_STEP", "4")
    monkeypatch.setenv("FSDPJOB_FAULT_SAVE_PAUSE_S", "1.5")
    monkeypatch.setenv("FSDPJOB_FAULT_SAVE_RANK", "1")
    hooks = TestHooks.from_env()
    assert hooks.stop_at_step == 4 and hooks.save_pause_s == 1.5 and hooks.save_pause_rank == 1
    assert hooks.save_pause_step is None and not hooks.log_samples


def test_worker_env_under_slurm_and_local(monkeypatch):
    for name in ("SLURM_JOB_ID", "SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID", "SLURM_RESTART_COUNT", "SLURM_PROCID",
                 "SUBMITIT_EXECUTOR", "SUBMITIT_LOCAL_JOB_ID", "SUBMITIT_LOCAL_GLOBALID", "RANK"):
        monkeypatch.delenv(name, raising=False)
    bare = WorkerEnv.from_env()
    assert bare.scheduler is None and bare.job_id is None and bare.restart_count == 0 and bare.log_rank == "0"
    monkeypatch.setenv("SUBMITIT_EXECUTOR", "slurm")
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "2")
    monkeypatch.setenv("SLURM_PROCID", "3")
    slurm = WorkerEnv.from_env()
    assert slurm.on_slurm and slurm.job_id == "77" and slurm.restart_count == 2 and slurm.log_rank == "3"
    for name in ("SLURM_JOB_ID", "SLURM_RESTART_COUNT", "SLURM_PROCID"):
        monkeypatch.delenv(name)
    monkeypatch.setenv("SUBMITIT_EXECUTOR", "local")
    monkeypatch.setenv("SUBMITIT_LOCAL_JOB_ID", "5150")
    monkeypatch.setenv("SUBMITIT_LOCAL_GLOBALID", "1")
    local = WorkerEnv.from_env()
    assert not local.on_slurm and local.job_id == "5150" and local.log_rank == "1"
