"""Training progress as the login node reads it from a run folder (no scheduler, no torch): step and loss
from metrics.jsonl, restarts and steps lost from events.jsonl, the last committed checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

from fsdpjob.orchestrator.core.runfolder.ckptlayout import MARKER, step_dir_name
from fsdpjob.orchestrator.core.runfolder.paths import RunPaths
from fsdpjob.orchestrator.core.runfolder.runmeta import RunMeta
from fsdpjob.orchestrator.views.progress import read_progress


def write_lines(path: Path, rows: list[dict], tail: str = "") -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + tail)


def step_folder(root: Path, step: int, committed: bool) -> None:
    folder = root / step_dir_name(step)
    folder.mkdir(parents=True)
    if committed:
        (folder / MARKER).write_text("{}\n")


def test_a_preempted_and_resumed_run(tmp_path):
    write_lines(tmp_path / "metrics.jsonl", [
        {"step": s, "loss": 5.0 - s / 10, "time": 10 + s} for s in range(1, 8)     # first attempt reached 7
    ] + [{"step": s, "loss": 5.0 - s / 10, "time": 100 + s} for s in range(6, 10)],  # second went on from 5
        tail='{"step": 10, "lo')  # a line being written right now
    write_lines(tmp_path / "events.jsonl", [
        {"event": "start", "time": 1},
        {"event": "checkpoint", "step": 5, "time": 16},
        {"event": "start", "time": 90},
        {"event": "resume", "step": 5, "time": 95},
    ])
    for step, committed in ((5, True), (9, False)):  # step 9: a save killed before its marker
        step_folder(tmp_path / "checkpoints", step, committed)
    prog = read_progress(tmp_path)
    assert (prog.step, prog.loss) == (9, 5.0 - 0.9)
    assert (prog.restarts, prog.steps_lost, prog.last_checkpoint_step) == (1, 2, 5)
    assert not prog.done and prog.failure is None


def test_a_stop_the_supervisor_restarted_in_the_allocation_is_no_requeue(tmp_path):
    """srun's teardown of the step (issue 55): a stop event the supervisor restarted in the allocation; the second
    start is its relaunch, not the scheduler's (status said restarts 1 on the dev cluster)."""
    write_lines(tmp_path / "events.jsonl", [
        {"event": "start", "time": 1}, {"event": "checkpoint", "step": 5, "time": 2},
        {"event": "stop", "reason": "teardown", "requeued": False, "restarted": True, "step": 12, "time": 3},
        {"event": "start", "time": 4}, {"event": "resume", "step": 12, "time": 5},
        {"event": "done", "step": 60, "time": 6},
    ])
    prog = read_progress(tmp_path)
    assert prog.done and (prog.restarts, prog.restarts_in_allocation, prog.steps_lost) == (0, 1, 0)


def test_done_and_failed_follow_the_latest_start(tmp_path):
    write_lines(tmp_path / "events.jsonl", [
        {"event": "start", "time": 1}, {"event": "failed", "error": "RuntimeError: gloo", "time": 2},
        {"event": "start", "time": 3}, {"event": "done", "step": 40, "time": 4},
    ])
    prog = read_progress(tmp_path)
    assert prog.done and prog.failure is None and prog.step == 40 and prog.restarts == 1


def test_checkpoints_are_read_where_the_spec_put_them(tmp_path):
    elsewhere = tmp_path / "scratch" / "ckpt"
    run = tmp_path / "run"
    run.mkdir()
    RunMeta(spec={"checkpoint": {"dir": str(elsewhere)}}).write(RunPaths(run))
    step_folder(elsewhere, 30, committed=True)
    step_folder(run / "checkpoints", 10, committed=True)  # not this run's checkpoint root
    assert read_progress(run).last_checkpoint_step == 30


def test_an_empty_run_folder(tmp_path):
    prog = read_progress(tmp_path)
    assert (prog.step, prog.restarts, prog.last_checkpoint_step, prog.done) == (None, 0, None, False)


def test_steps_lost_to_a_crash_count_even_when_the_metrics_lie_beyond_the_tail(tmp_path):
    # A long run: metrics.jsonl is far larger than the tail status reads, so the crash's step comes from
    # the failure policy's requeue event (supervise/failure.py records the step the attempt reached).
    filler = "x" * 200
    write_lines(tmp_path / "metrics.jsonl", [{"step": s, "loss": 1.0, "time": 10 + s, "note": filler}
                                             for s in range(1, 1001)])
    write_lines(tmp_path / "events.jsonl", [
        {"event": "start", "restart": 0, "time": 1},
        {"event": "checkpoint", "step": 400, "time": 410},
        {"event": "requeue", "reason": "failure", "step": 437, "time": 448},
        {"event": "start", "restart": 1, "time": 500},
        {"event": "resume", "step": 400, "time": 505},
    ])
    assert (tmp_path / "metrics.jsonl").stat().st_size > 3 * 65536
    assert read_progress(tmp_path).steps_lost == 37


def test_a_crash_before_the_first_checkpoint_loses_every_step_it_trained(tmp_path):
    write_lines(tmp_path / "metrics.jsonl", [{"step": s, "loss": 1.0, "time": 10 + s} for s in range(1, 31)]
                + [{"step": s, "loss": 1.0, "time": 100 + s} for s in range(1, 6)])
    write_lines(tmp_path / "events.jsonl", [
        {"event": "start", "restart": 0, "time": 1}, {"event": "ready", "step": 0, "time": 5},
        {"event": "failed", "error": "DistBackendError: peer gone", "step": 30, "time": 41},
        {"event": "start", "restart": 1, "time": 90}, {"event": "ready", "step": 0, "time": 95},  # no checkpoint
    ])
    prog = read_progress(tmp_path)
    assert (prog.restarts, prog.steps_lost, prog.step) == (1, 30, 5)


def test_eval_lines_give_the_eval_loss_and_leave_the_training_values_alone(tmp_path):
    write_lines(tmp_path / "metrics.jsonl", [
        {"step": 1, "loss": 3.0, "tokens_per_s": 100.0, "eta_s": 9.0, "time": 11},
        {"step": 2, "loss": 2.5, "tokens_per_s": 110.0, "eta_s": 8.0, "time": 12},
        {"step": 2, "time": 13, "eval_loss": 2.75, "eval_tokens": 300, "eval_s": 0.5},  # train.eval_every 2
    ])
    prog = read_progress(tmp_path)
    assert (prog.step, prog.loss, prog.tokens_per_s, prog.eta_s) == (2, 2.5, 110.0, 8.0)
    assert (prog.eval_loss, prog.eval_step) == (2.75, 2)
    write_lines(tmp_path / "metrics.jsonl", [{"step": 1, "loss": 3.0, "time": 11}])
    assert read_progress(tmp_path).eval_loss is None  # no evaluation (yet): null in status --json


def test_a_crash_between_logged_steps_reports_the_step_it_reached(tmp_path):
    """Issue 54, also found: a run that fails before its first logged step (log_every above the steps it trained)
    shows the step its failure event carries, not none (`FAILED at step None/3`, then "before its first step"
    for a run that had trained)."""
    write_lines(tmp_path / "events.jsonl", [
        {"event": "start", "time": 1}, {"event": "ready", "step": 0, "time": 2},
        {"event": "failed", "step": 2, "error": "RuntimeError: boom", "time": 9},
    ])
    prog = read_progress(tmp_path)
    assert (prog.step, prog.failure) == (2, "RuntimeError: boom")
    write_lines(tmp_path / "metrics.jsonl", [{"step": 1, "loss": 4.0, "time": 5}])
    assert read_progress(tmp_path).step == 2  # a logged step before it does not hide it
    write_lines(tmp_path / "events.jsonl", [{"event": "start", "time": 1},
                                            {"event": "failed", "step": None, "error": "OSError", "time": 3}])
    (tmp_path / "metrics.jsonl").unlink()
    assert read_progress(tmp_path).step is None  # a failure in the set-up has none
