"""The stop hand-off (issue 23): workers commit a stop checkpoint and hand the stop over; the batch side asks
Slurm what it was and requeues. Workers run no Slurm command, so they can run in a container without Slurm's
binaries or munge. The end-to-end path is in tests/slurm (preemption, external requeue, time limit, cap, with
workers whose PATH holds no Slurm binary); here: the record, the classification, the requeue outcomes, the
rendezvous address, and a scan of jobs/ for Slurm commands."""

from __future__ import annotations

import ast
import json
import socket
from pathlib import Path
from types import SimpleNamespace

import pytest

from fsdpjob.orchestrator.core import slurmenv
from fsdpjob.orchestrator.core.errors import SlurmCommandError
from fsdpjob.orchestrator.core.runfolder import stophandoff
from fsdpjob.orchestrator.core.runfolder.attempts import cap_reached
from fsdpjob.orchestrator.core.runfolder.stophandoff import NOT_REQUEUED, REQUEUED, StopHandoff
from fsdpjob.orchestrator.slurm import commands as slurm_cli
from fsdpjob.orchestrator.slurm import stop
from fsdpjob.orchestrator.supervise import stopfinish

RECORDED = Path(__file__).parent / "data" / "slurm-22.05"
JOBS = Path(__file__).resolve().parents[1] / "jobs"
SLURM_BINARIES = {"sacct", "sacctmgr", "salloc", "sattach", "sbatch", "sbcast", "scancel", "scontrol", "sinfo",
                  "sprio", "squeue", "sreport", "srun", "sshare", "sstat", "strigger", "munge", "unmunge"}


def handoff(launch: int = 0, step: int = 12) -> StopHandoff:
    return StopHandoff(launch=launch, step=step, signal=12, save_s=1.25, signal_to_commit_s=3.5, committed_at=100.0)


def events(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]


def test_a_handoff_is_taken_once_and_only_by_its_own_launch(tmp_path):
    stophandoff.write(tmp_path, handoff(launch=2))
    assert stophandoff.take(tmp_path, 1) is None  # an older file is never taken for a newer stop
    assert not (tmp_path / "stop.json").exists()
    stophandoff.write(tmp_path, handoff(launch=2))
    assert stophandoff.take(tmp_path, 2) == handoff(launch=2)
    assert stophandoff.take(tmp_path, 2) is None


@pytest.mark.parametrize("text", ["", "{", '{"launch": 0}', '{"launch": "0", "step": 1, "signal": 12, "save_s": 1.0, '
                                  '"signal_to_commit_s": 1.0, "committed_at": 1.0}'])
def test_a_damaged_handoff_is_no_stop(tmp_path, text):
    (tmp_path / "stop.json").write_text(text)
    assert stophandoff.take(tmp_path, 0) is None


def test_a_stop_record_is_what_status_and_report_read(tmp_path):
    stophandoff.record_stop(tmp_path, handoff(), reason="time_limit", outcome=REQUEUED, detail="requeued Slurm job 7",
                            handoff_s=0.4)
    [ev] = events(tmp_path)
    assert {k: ev[k] for k in ("event", "reason", "step", "requeued", "signal", "save_s", "signal_to_commit_s",
                               "handoff_s")} == {
        "event": "stop", "reason": "time_limit", "step": 12, "requeued": True, "signal": 12, "save_s": 1.25,
        "signal_to_commit_s": 3.5, "handoff_s": 0.4}
    stophandoff.record_stop(tmp_path, handoff(), reason="preemption", outcome=NOT_REQUEUED, detail="cap reached")
    stop_ev, failed = events(tmp_path)[1:]
    assert stop_ev["requeued"] is False and failed["event"] == "failed" and failed["retryable"] is False


@pytest.mark.parametrize("info, restarts, kind", [
    ({"JobState": "RUNNING", "PreemptTime": "2026-12-03T06:00:00", "Restarts": "0"}, 0, "preemption"),
    ({"JobState": "RUNNING", "PreemptTime": "None", "Restarts": "1"}, 0, "requeue"),
    ({"JobState": "RUNNING", "PreemptTime": "None", "Restarts": "1"}, 1, "time_limit"),
    ({}, 0, "signal"),
])
def test_classify_reads_what_scontrol_shows(info, restarts, kind):
    assert stop.classify(info, restarts) == kind


def test_classify_on_a_recorded_scontrol_job():
    info = slurm_cli.parse_scontrol((RECORDED / "scontrol-show-job-pending.txt").read_text())
    assert stop.classify(info, 1) == "requeue" and stop.classify(info, 2) == "time_limit"


def finish(tmp_path, monkeypatch, *, requeue, state="RUNNING", info=None, restarts=0,
           capped=None) -> tuple[int, list[dict]]:
    monkeypatch.setattr(slurm_cli, "scontrol_job", lambda job_id: info if info is not None else {"Restarts": "0"})
    monkeypatch.setattr(slurm_cli, "requeue_unless_cancelled", requeue)
    monkeypatch.setattr(slurm_cli, "job_state", lambda job_id: state)
    rc = stopfinish.finish_stop(tmp_path, handoff(), stop.settle("7", restart_count=restarts, capped=capped))
    return rc, events(tmp_path)


def test_finish_stop_requeues_once_and_records(tmp_path, monkeypatch):
    asked = []
    rc, evs = finish(tmp_path, monkeypatch, requeue=lambda job_id: asked.append(job_id))
    assert rc == 0 and asked == ["7"]
    assert [(e["event"], e["reason"], e["requeued"]) for e in evs] == [("stop", "time_limit", True)]
    assert evs[0]["handoff_s"] >= 0


def test_finish_stop_of_a_cancelled_job_records_a_cancel(tmp_path, monkeypatch):
    rc, evs = finish(tmp_path, monkeypatch, requeue=lambda job_id: "job 7 was cancelled; not requeueing it")
    assert rc == 0 and [(e["reason"], e["requeued"]) for e in evs] == [("cancelled", False)]


def test_finish_stop_when_slurm_is_already_requeueing(tmp_path, monkeypatch):
    def refuse(job_id):
        raise SlurmCommandError(["scontrol", "requeue", job_id], 1, "Job is pending execution")

    rc, evs = finish(tmp_path, monkeypatch, requeue=refuse, state="COMPLETING",
                     info={"PreemptTime": "2026-12-03T06:00:00", "Restarts": "0"})
    assert rc == 0 and (evs[0]["reason"], evs[0]["requeued"]) == ("preemption", True)
    assert "already being requeued (COMPLETING)" in evs[0]["detail"]


def test_finish_stop_past_the_cap_fails_the_job(tmp_path, monkeypatch):
    asked = []
    rc, evs = finish(tmp_path, monkeypatch, requeue=lambda job_id: asked.append(job_id), restarts=2,
                     capped=cap_reached(3, 2))
    assert rc == 1 and asked == []
    assert [e["event"] for e in evs] == ["stop", "failed"] and "requeue cap reached" in evs[0]["detail"]


def test_finish_stop_without_scontrol_still_requeues(tmp_path, monkeypatch):
    def broken(job_id):
        raise SlurmCommandError(["scontrol", "show", "job", job_id], 1, "slurm_load_jobs error")

    monkeypatch.setattr(slurm_cli, "scontrol_job", broken)
    monkeypatch.setattr(slurm_cli, "requeue_unless_cancelled", lambda job_id: None)
    assert stopfinish.finish_stop(tmp_path, handoff(), stop.settle("7", restart_count=0, capped=None)) == 0
    assert [(e["reason"], e["requeued"]) for e in events(tmp_path)] == [("signal", True)]


def test_node_addresses_travel_in_one_variable():
    text = slurmenv.format_node_addrs({"n2": "10.0.0.2", "n1": "10.0.0.1"})
    assert text == "n1=10.0.0.1,n2=10.0.0.2"
    assert slurmenv.node_addrs(text) == {"n1": "10.0.0.1", "n2": "10.0.0.2"}
    assert slurmenv.node_addrs(None) == {} and slurmenv.node_addrs("junk,=x,n3=") == {}


def test_the_worker_takes_the_rendezvous_address_from_the_supervisor():
    pytest.importorskip("torch")
    from fsdpjob.jobs.dist import resolve_master_addr

    assert resolve_master_addr("n1", {"FSDPJOB_NODE_ADDRS": "n1=127.0.0.1"}) == "127.0.0.1"
    assert resolve_master_addr("localhost", {}) == "localhost"  # a name that resolves stays a name
    with pytest.raises(RuntimeError, match="does not resolve and the supervisor passed no address"):
        resolve_master_addr("no-such-node.invalid", {})


def test_the_supervisor_resolves_only_names_that_do_not_resolve(monkeypatch):
    from fsdpjob.orchestrator.supervise import allocation
    from fsdpjob.orchestrator.supervise.allocation import SlurmAllocation

    monkeypatch.setenv("SLURM_JOB_NODELIST", "x")
    monkeypatch.setattr(slurm_cli, "hostnames", lambda nodelist: ["localhost", "n9.invalid"])
    asked = []
    monkeypatch.setattr(slurm_cli, "node_addr", lambda node, timeout: asked.append(node) or "10.9.9.9")
    monkeypatch.setattr(allocation, "reachable_address", lambda node: "10.0.0.3" if node == "n3" else None)
    monkeypatch.setattr(slurm_cli, "hostnames", lambda nodelist: ["n3", "n9.invalid"])
    assert SlurmAllocation(nodes=2, job_id="7").worker_env() == {"FSDPJOB_NODE_ADDRS": "n9.invalid=10.9.9.9"}
    assert asked == ["n9.invalid"]


def test_a_name_that_resolves_to_loopback_counts_as_unresolved_when_the_job_spans_nodes(monkeypatch):
    """Debian's and Ubuntu's /etc/hosts map a host's own name to 127.0.1.1: the batch node (the rendezvous node)
    resolves its name to loopback, and without NodeAddr its gloo would bind to lo and hang across nodes."""
    from fsdpjob.orchestrator.core import rendezvous
    from fsdpjob.orchestrator.supervise import allocation
    from fsdpjob.orchestrator.supervise.allocation import SlurmAllocation

    real = socket.getaddrinfo
    hosts = {"gpu01": "127.0.1.1", "gpu02": "10.1.0.2"}

    def getaddrinfo(name, *args, **kwargs):
        if name in hosts:
            return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (hosts[name], 0))]
        return real(name, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    assert rendezvous.reachable_address("gpu01") is None and rendezvous.reachable_address("gpu02") == "10.1.0.2"
    assert rendezvous.reachable_address("localhost") is None and rendezvous.reachable_address("x.invalid") is None
    assert rendezvous.is_loopback("127.0.1.1") and rendezvous.is_loopback("::1") and not rendezvous.is_loopback("n1")

    monkeypatch.setenv("SLURM_JOB_NODELIST", "gpu[01-02]")
    monkeypatch.setattr(slurm_cli, "hostnames", lambda nodelist: ["gpu01", "gpu02"])
    asked = []
    monkeypatch.setattr(slurm_cli, "node_addr", lambda node, timeout: asked.append(node) or "10.1.0.1")
    assert SlurmAllocation(nodes=2, job_id="7").worker_env() == {"FSDPJOB_NODE_ADDRS": "gpu01=10.1.0.1"}
    assert asked == ["gpu01"]
    # One node: its ranks meet on loopback, nothing to ask
    monkeypatch.setattr(slurm_cli, "hostnames", lambda nodelist: ["gpu01"])
    assert SlurmAllocation(nodes=1, job_id="7").worker_env() == {} and asked == ["gpu01"]
    assert allocation.reachable_address is rendezvous.reachable_address


def _called_binaries(tree: ast.AST) -> set[str]:
    """String constants that name a Slurm or munge binary (as an argv's first item or a command string)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            first = node.value.strip().split(" ", 1)[0]
            if first in SLURM_BINARIES:
                found.add(first)
    return found


def test_no_worker_module_names_a_slurm_command():
    assert _called_binaries(ast.parse('run(["scontrol", "requeue", j]); f"srun -w {n} true"')) == {"scontrol", "srun"}
    offenders = {str(p.relative_to(JOBS)): sorted(found) for p in sorted(JOBS.rglob("*.py"))
                 if (found := _called_binaries(ast.parse(p.read_text())))}
    assert offenders == {}


@pytest.mark.parametrize("cancelled", [False, True])
def test_a_local_stop_after_fsdpjob_cancel_is_a_cancel_and_restarts_nothing(tmp_path, cancelled):
    """Locally rank 0 records the stop itself: `fsdpjob cancel` wrote its cancel event before its signal."""
    from fsdpjob.jobs import preemption
    from fsdpjob.jobs.workerenv import WorkerEnv
    from fsdpjob.orchestrator.core.runfolder import runlog

    if cancelled:
        runlog.append(tmp_path, runlog.CANCEL, by="fsdpjob cancel")
    flag = SimpleNamespace(received_at=99.0)  # a StopFlag's record, without its handlers in this process
    worker = WorkerEnv(scheduler="local", slurm_job_id=None, local_job_id="7", restart_count=0, log_rank="0",
                       host="h")
    endings: list[str] = []
    with pytest.raises(SystemExit) as leave:
        preemption.stop_and_hand_off(12, 40, is_main=True, stop=flag, worker=worker, max_requeues=3,
                                     save_started=100.0, run_dir=tmp_path, ending=endings.append,
                                     share=lambda outcome: outcome)
    stop = runlog.first(events(tmp_path), runlog.STOP)
    assert (stop["reason"], stop["requeued"], stop["step"]) == (("cancelled", False, 40) if cancelled
                                                                 else ("signal", True, 40))
    # 144 asks submitit's local controller for a restart; 0 after a cancel: nothing comes back, nothing failed.
    assert leave.value.code == (0 if cancelled else preemption.LOCAL_REQUEUE_EXIT_CODE)
    assert runlog.first(events(tmp_path), runlog.FAILED) is None and endings == [runlog.STOP]


# A SIGTERM that is neither a preemption nor a time limit (issue 55): srun's teardown of the step after a task's
# shell ended. On the dev cluster the ranks saved a stop the supervisor read as a time limit and requeued the job
# (~2 min in Slurm's hold). The controller's SIGTERMs reach the batch step too; srun's teardown does not.
RUNNING = {"JobState": "RUNNING", "PreemptTime": "None", "Restarts": "0"}


@pytest.mark.parametrize("info, signum, supervisor_signalled, kind", [
    (RUNNING, 15, False, "teardown"),  # the ranks' SIGTERM came from srun: only the step got it
    (RUNNING, 15, True, "time_limit"),  # the batch step got one too: Slurm's (the time limit's end, scancel)
    (RUNNING, 12, False, "time_limit"),  # the time limit's warning is the profile's signal, never SIGTERM
    ({**RUNNING, "JobState": "COMPLETING"}, 15, False, "time_limit"),  # the job is ending: not a restart here
    ({**RUNNING, "PreemptTime": "2026-12-03T06:00:00"}, 15, False, "preemption"),
    ({**RUNNING, "Restarts": "1"}, 15, False, "requeue"),
])
def test_a_sigterm_only_the_step_got_is_a_teardown(info, signum, supervisor_signalled, kind):
    assert stop.classify(info, 0, signum=signum, supervisor_signalled=supervisor_signalled) == kind


def test_a_teardown_on_a_recorded_pending_job_is_no_teardown():
    info = slurm_cli.parse_scontrol((RECORDED / "scontrol-show-job-pending.txt").read_text())
    assert stop.classify(info, 2, signum=15, supervisor_signalled=False) == "time_limit"


def _teardown(tmp_path, monkeypatch, restart_here):
    asked = []
    monkeypatch.setattr(slurm_cli, "scontrol_job", lambda job_id: RUNNING)
    monkeypatch.setattr(slurm_cli, "requeue_unless_cancelled", lambda job_id: asked.append(job_id))
    term = StopHandoff(launch=0, step=12, signal=15, save_s=1.0, signal_to_commit_s=2.0, committed_at=100.0)
    settled = stop.settle("7", restart_count=0, capped=None, signum=15, supervisor_signalled=False,
                          restart_here=restart_here)
    return stopfinish.finish_stop(tmp_path, term, settled), events(tmp_path), asked


def test_a_teardown_stop_restarts_the_workers_here_without_a_requeue(tmp_path, monkeypatch):
    rc, evs, asked = _teardown(tmp_path, monkeypatch, "restarting the workers in this allocation (restart 1 of 3)")
    assert rc is None and asked == []  # None: the supervisor's loop starts the next launch
    [ev] = evs
    assert (ev["reason"], ev["requeued"], ev["restarted"]) == ("teardown", False, True)
    assert "srun's teardown" in ev["detail"] and "restart 1 of 3" in ev["detail"]


def test_a_teardown_past_the_restart_budget_requeues_as_before(tmp_path, monkeypatch):
    rc, evs, asked = _teardown(tmp_path, monkeypatch, None)
    assert rc == 0 and asked == ["7"]
    assert [(e["reason"], e["requeued"], "restarted" in e) for e in evs] == [("teardown", True, False)]
