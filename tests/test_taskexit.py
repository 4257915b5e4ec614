"""The task's shell (core/runfolder/taskexit.py), run for real, and the crash blame it feeds (supervise/blame.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from fsdpjob.orchestrator.core.errors import is_peer_error
from fsdpjob.orchestrator.core.runfolder.heartbeat import Beat
from fsdpjob.orchestrator.core.runfolder.taskexit import SHELL_NAME, TaskExit, read_task_exits, task_shell
from fsdpjob.orchestrator.supervise.blame import blame_crash, srun_task_exit

RESET = "RuntimeError: [gloo/transport/tcp/pair.cc:534] Read error [127.0.0.1]:4242: Connection reset by peer."


def _task(tmp_path, rank: int, *worker: str, launch: int = 3) -> subprocess.CompletedProcess:
    (tmp_path / "heartbeat").mkdir(exist_ok=True)
    env = {**os.environ, "FSDPJOB_RUN_DIR": str(tmp_path), "FSDPJOB_LAUNCH": str(launch), "SLURM_PROCID": str(rank)}
    return subprocess.run(["sh", "-c", task_shell("USR2"), SHELL_NAME, *worker], env=env, timeout=30)


def test_the_shell_records_the_workers_own_end_and_keeps_its_status(tmp_path) -> None:
    killed = _task(tmp_path, 1, sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)")
    failed = _task(tmp_path, 0, sys.executable, "-c", "raise SystemExit(3)")
    done = _task(tmp_path, 2, "true")
    assert (killed.returncode, failed.returncode, done.returncode) == (137, 3, 0)
    exits = read_task_exits(tmp_path, 3)
    assert [(e.rank, e.code) for e in exits] == [(1, 137), (0, 3), (2, 0)]  # in the order they were written
    assert exits[0].signal == 9 and exits[0].describe() == "killed by signal 9" and exits[1].signal is None
    assert read_task_exits(tmp_path, 4) == []  # another launch's files are not this one's


def test_the_shell_outlives_sigterm_and_the_stop_signal_and_the_worker_inherits_them_ignored(tmp_path) -> None:
    """Slurm signals every process of the step: the shell must not end while the worker saves."""
    worker = ("import os, signal, sys, time\n"
              "ignored = [signal.getsignal(s) == signal.SIG_IGN for s in (signal.SIGTERM, signal.SIGUSR2)]\n"
              "os.kill(os.getppid(), signal.SIGTERM); os.kill(os.getppid(), signal.SIGUSR2); time.sleep(0.3)\n"
              "sys.exit(5 if all(ignored) else 6)")
    assert _task(tmp_path, 0, sys.executable, "-c", worker).returncode == 5
    assert [(e.rank, e.code) for e in read_task_exits(tmp_path, 3)] == [(0, 5)]


def test_a_run_folder_that_cannot_be_written_leaves_the_status_alone(tmp_path) -> None:
    env = {**os.environ, "FSDPJOB_RUN_DIR": str(tmp_path / "missing"), "FSDPJOB_LAUNCH": "0", "SLURM_PROCID": "0"}
    done = subprocess.run(["sh", "-c", task_shell("USR2"), SHELL_NAME, "sh", "-c", "exit 7"], env=env,
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 7 and done.stderr == ""


def _beat(rank: int, t: float) -> Beat:
    return Beat(rank=rank, host="n1" if rank < 2 else "n2", machine="m", pid=100 + rank, launch=2, step=22,
                phase="training step", phase_since=t, time=t)


def _failed(rank: int, t: float, error: str) -> dict:
    return {"event": "failed", "rank": rank, "time": t, "error": error}


def test_the_first_task_exit_decides_where_the_racing_facts_blamed_two_ranks() -> None:
    """CI, the hang-then-crashes test's launch 2 (workers in the test image): rank 2 on n2 SIGKILLed; rank 0 on n1,
    torn down before it wrote an error, had its last heartbeat before its peers' first error, and srun printed n1's
    line first: ranks [0, 2] were blamed. The task shells' records say rank 2 ended first, and nothing else did
    on its own (rank 0's shell went with srun's SIGKILL)."""
    beats = [_beat(0, 99.8), _beat(1, 100.6), _beat(2, 99.9), _beat(3, 100.6)]
    events = [_failed(1, 100.2, RESET), _failed(3, 100.3, RESET)]
    srun = [srun_task_exit(x) for x in ("srun: error: n1: task 0: Killed",
                                        "srun: error: n2: task 2: Exited with exit code 137")]
    assert blame_crash(beats, events, gone=(0, 1, 2, 3), srun=srun, srun_untouched=0).ranks == (0, 2)  # the race
    exits = [TaskExit(2, 137, 100.05), TaskExit(3, 1, 100.31), TaskExit(1, 1, 100.4)]
    found = blame_crash(beats, events, gone=(0, 1, 2, 3), srun=srun, srun_untouched=0, task_exits=exits)
    assert found.ranks == (2,) and found.hosts == ("n2",) and found.casualties == (1, 3), found
    assert found.exits[2] == "ended first (killed by signal 9)", found.exits


def test_a_casualty_whose_shell_wrote_first_is_passed_over_and_a_clean_exit_is_no_cause() -> None:
    beats = [_beat(r, 100.0) for r in range(4)]
    events = [_failed(0, 100.01, RESET)]
    exits = [TaskExit(0, 1, 100.02), TaskExit(3, 0, 100.03), TaskExit(1, 139, 100.04)]
    found = blame_crash(beats, events, task_exits=exits)
    assert found.ranks == (1,) and found.casualties == (0,), found
    assert found.exits[1] == "ended first (killed by signal 11)"
    # No task wrote an exit (a node lost with its shells): the other facts decide, as before.
    beats = [_beat(r, 99.9 if r == 2 else 100.5) for r in range(4)]
    assert blame_crash(beats, events, task_exits=[TaskExit(0, 1, 100.02)]).ranks == (2,)


def test_task_exits_written_after_the_supervisors_signal_are_the_teardowns() -> None:
    """After the supervisor's SIGTERM every worker ends by its handler, and a shell's record then says nothing of
    who died first: rank 0's, written first, blamed rank 0 where the supervisor had seen rank 1 gone."""
    beats = [_beat(r, 100.0) for r in range(4)]
    exits = [TaskExit(0, 143, 100.51), TaskExit(1, 143, 100.52), TaskExit(3, 143, 100.53), TaskExit(2, 143, 100.6)]
    assert blame_crash(beats, [], gone=(1,), srun_untouched=0, task_exits=exits).ranks == (0,)  # the defect
    found = blame_crash(beats, [], gone=(1,), srun_untouched=0, task_exits=exits, signalled_at=100.5)
    assert found.ranks == (1,) and found.hosts == ("n1",), found
    assert found.exits[1].startswith("the supervisor saw its process end first"), found.exits
    # A death recorded before the signal still decides.
    exits = [TaskExit(1, 137, 100.2), *exits[:1]]
    assert blame_crash(beats, [], gone=(1,), task_exits=exits, signalled_at=100.5).exits[1] == \
        "ended first (killed by signal 9)"
    # gloo's transport errors are about its connections: a peer's socket gone mid-message fails an enforce.
    assert is_peer_error("RuntimeError: [enforce fail at ../third_party/gloo/gloo/transport/tcp/pair.cc:446] "
                         "op.preamble.length <= op.nbytes. 8773256 vs 4")


@pytest.mark.parametrize("error", [
    "RuntimeError: [../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 600000ms for recv "
    "operation to complete",
    "DistBackendError: [Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=12, OpType=ALLREDUCE, "
    "NumelIn=1, NumelOut=1, Timeout(ms)=600000) ran for 600012 milliseconds before timing out.",
    "DistStoreError: Timed out after 901 seconds waiting for clients. 1/2 clients joined.",
    "DistNetworkError: Connection reset by peer",
])
def test_a_collectives_or_the_stores_timeout_is_a_peers_casualty(error: str) -> None:
    assert is_peer_error(error)


@pytest.mark.parametrize("error", [
    "ReadTimeout: HTTPConnectionPool(host='reward', port=8000): Read timed out. (read timeout=10)",
    "TimeoutError: timed out",
    "TimeoutError: reading /data/shard-00003.parquet timed out after 120 s",
    "RuntimeError: reward function call timed out",
])
def test_a_ranks_own_timeout_is_no_peers_casualty(error: str) -> None:
    """A data read or a reward call that timed out is the rank's own failure: "timed out" alone used to make it a
    casualty, and the blame then passed over the one rank that failed first (issue 55)."""
    assert not is_peer_error(error)
    beats = [_beat(r, 100.0) for r in range(2)]
    events = [{"event": "failed", "rank": 1, "error": error},
              {"event": "failed", "rank": 0, "error": "DistNetworkError: Connection closed by peer"}]
    found = blame_crash(beats, events)
    assert found.ranks == (1,) and found.casualties == (0,), found
