"""The local backend: the workers as processes on this machine through submitit's local executor, which
behave like a batch job (they outlive the CLI, ignore hangups, stop with a stop checkpoint on `fsdpjob cancel`)."""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import sys
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path

from fsdpjob.orchestrator import backend as api
from fsdpjob.orchestrator.backend import AttemptTimes, Request, SchedView, Submitted, Unsupported
from fsdpjob.orchestrator.core.errors import FsdpjobError
from fsdpjob.orchestrator.core.jobspec.methods import workers_python
from fsdpjob.orchestrator.core.runfolder import runlog
from fsdpjob.orchestrator.core.runfolder.paths import RunPaths

# Seconds a local run gets for its stop checkpoint after SIGTERM before fsdpjob cancel kills what is left.
LOCAL_CANCEL_GRACE_S = 15


# What the local backend cannot do, in its own words (why, and what to do instead).
REFUSALS = {
    api.CHAINS: "a local run starts at once; submit with a Slurm profile, or run the two jobs one after the other",
    api.START_ESTIMATES: "a local run starts at once; ask with a Slurm profile",
    api.EXPORT_JOBS: "run `fsdpjob export` without --submit (it exports on this machine now)",
}


class LocalBackend:
    name = "local"
    account = "local"  # the local processes' life: from the submit to their last write (_allocation)
    # A local run is this terminal's job: Ctrl-C in `submit --wait` stops it (as `fsdpjob cancel` does: a stop
    # checkpoint), not by the SIGINT, which its own session keeps from the workers; an array runs one at a time.
    foreground = True
    host_from_events = True  # the controller's view names this machine only while it runs

    def dry_run(self, job, paths: RunPaths) -> Request:
        from fsdpjob.orchestrator.supervise.launchline import describe

        # The workers inherit this environment: the profile's and the spec's variables, secrets included.
        env = {**job.profile.env, **job.spec.env, "FSDPJOB_RUN_DIR": str(paths.run_dir)}
        if job.eff.cpus_per_task:
            env.setdefault("OMP_NUM_THREADS", str(job.eff.cpus_per_task))
        text = describe(job.profile.name, paths.run_dir, paths.submitit_dir, job.eff.tasks_per_node,
                        job.eff.time_limit_s, job.eff.signal_lead_s, env, job.spec.secret_names(),
                        python=_workers_python(job.spec))
        return Request(paths=paths, text=text, script=None, env=env)

    def submit(self, job, request: Request) -> Submitted:
        from fsdpjob.jobs.entry import TrainJob
        from fsdpjob.orchestrator.supervise.launch import SupervisedLocalExecutor

        executor = SupervisedLocalExecutor(str(request.paths.submitit_dir), str(request.paths.run_dir),
                                           python=_workers_python(job.spec))
        executor.update_parameters(
            tasks_per_node=job.eff.tasks_per_node,
            nodes=1,
            timeout_min=job.eff.time_limit_s / 60,
            signal_delay_s=job.eff.signal_lead_s,
        )
        with _stdio_detached():
            handle = executor.submit(TrainJob(str(request.paths.run_dir)))
        return Submitted(job_id=str(handle.job_id))

    def views(self, records) -> dict[str, SchedView]:
        return {r.job_id: self.view(r) for r in records}

    def view(self, record) -> SchedView:
        """The submitit controller process (pid = job id), then its result pickles; with the one allocation."""
        view = _controller_view(record)
        return replace(view, attempts=(_allocation(record, view.state),))

    def attempts(self, record) -> list[AttemptTimes]:
        return list(self.view(record).attempts)

    def cancel(self, record, *, mark) -> str:
        """The cancel Slurm's scancel makes: SIGTERM, which the supervisor passes to submitit's controller and it
        to the ranks, whose stop flag it sets (as for a preemption); they commit a stop checkpoint and, finding
        the cancel event that ``mark`` wrote first, record a stop with reason ``cancelled`` and restart nothing
        (jobs/preemption.py). Whatever of this run still runs after the grace is killed, as Slurm's KillWait."""
        pid = int(record.job_id)
        if not controller_alive(record):
            raise FsdpjobError(f"local run {record.run_id} is not running (pid {pid} is gone)")
        workers = _children(pid)
        mark()  # before the signal: the workers and the controller's view read it
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + LOCAL_CANCEL_GRACE_S
        while controller_alive(record) and time.monotonic() < deadline:
            time.sleep(0.2)
        folder = str(RunPaths(Path(record.run_dir)).submitit_dir).encode()
        killed = []
        for victim in [*workers, pid]:
            try:  # only processes still running this run (their command lines name its submitit folder)
                if folder in Path(f"/proc/{victim}/cmdline").read_bytes():
                    os.kill(victim, signal.SIGKILL)
                    killed.append(victim)
            except (OSError, ProcessLookupError):
                pass
        if killed:
            return f"not stopped within {LOCAL_CANCEL_GRACE_S} s of SIGTERM; SIGKILLed {len(killed)} process(es)"
        stop = runlog.first(runlog.read_events(record.run_dir), runlog.STOP, reason="cancelled")
        return f"stopped by SIGTERM, stop checkpoint at step {stop['step']}" if stop else "stopped by SIGTERM"

    def log_path(self, record, rank: int, stream: str) -> Path:
        return RunPaths(Path(record.run_dir)).rank_log(record.job_id, rank, stream)

    # --- the optional capabilities: an array runs its tasks one after another; the others are refused -------------

    def refusal(self, capability: str) -> Unsupported | None:
        hint = REFUSALS.get(capability)
        return Unsupported(self.name, capability, hint) if hint else None

    def dry_run_array(self, array) -> Request:
        """The tasks one after another: this machine's cores go to one run at a time."""
        count = len(array.tasks)
        notes = (("the local profile runs a sweep's variants one after another; --max-parallel is ignored",)
                 if array.max_parallel and array.max_parallel > 1 else ())
        return Request(paths=array.tasks[0].paths, text=f"local profile: the {count} runs one after another\n",
                       script=None, env={}, notes=notes)

    def submit_array(self, array, request: Request, each) -> None:
        """Each task as a run of its own, started once the one before has ended (``each`` may follow it)."""
        for task in array.tasks:
            task_request = self.dry_run(task.job, task.paths)
            with api.job_environment(task_request.env):
                submitted = self.submit(task.job, task_request)
            each(task, submitted)
            while controller_alive(_Pid(submitted.job_id)):
                time.sleep(0.5)
        return None

    def dependency(self, parent, kind: str) -> str:
        raise self.refusal(api.CHAINS)

    def start_estimate(self, request: Request) -> str:
        raise self.refusal(api.START_ESTIMATES)

    def submit_export(self, record, profile, out: Path, dtype: str, merge: bool):
        raise self.refusal(api.EXPORT_JOBS)

    def partition_size(self, partition: str | None) -> None:
        return None  # one machine, no partitions


def _workers_python(spec) -> str | None:
    """The ranks' interpreter where it is not this one (grpo's vLLM colocated in them: generator.python)."""
    python = workers_python(spec.grpo, sys.executable)
    return None if python == sys.executable else python


def _controller_view(record) -> SchedView:
    if controller_alive(record):
        return SchedView(state="RUNNING", nodes=os.uname().nodename)
    if record.extra.get("cancelled"):
        return SchedView(state="CANCELLED")
    results = sorted(Path(record.run_dir, "submitit").glob(f"{int(record.job_id)}_*_result.pkl"))
    if not results:
        return SchedView(state="FAILED", reason="worker processes exited without a result")
    try:
        with open(results[0], "rb") as f:
            outcome = pickle.load(f)[0]
    except Exception:  # an unreadable pickle is a failed run
        outcome = "error"
    return SchedView(state="COMPLETED" if outcome == "success" else "FAILED")


def _allocation(record, state: str) -> AttemptTimes:
    """One allocation: the controller's life, from the submit (a local run starts at once) until it ended
    (the last write into its submitit folder: logs, result files); its workers' restarts happen inside it.
    Counting from the submit puts the workers' imports into start-up, where they belong."""
    end = None
    if state != "RUNNING":
        written = [p.stat().st_mtime for p in RunPaths(Path(record.run_dir)).submitit_dir.glob("*") if p.is_file()]
        end = max(written, default=record.submitted_at)
    start = record.submitted_at
    return AttemptTimes(queued_at=start, eligible_at=start, start=start, end=end, state=state)


@dataclass(frozen=True)
class _Pid:
    job_id: str  # what controller_alive reads of a record


def controller_alive(record) -> bool:
    """Whether the run's submitit controller (pid = job id) still runs; a recycled pid does not count."""
    try:
        with open(f"/proc/{int(record.job_id)}/cmdline", "rb") as f:
            return b"submitit" in f.read()
    except OSError:
        return False


def _children(pid: int) -> list[int]:
    """Every descendant of ``pid``: the supervisor's controller and its worker ranks."""
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            direct = [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
        for child in direct:
            out += [child, *_children(child)]
    return out


@contextlib.contextmanager
def _stdio_detached():
    """Start submitit's local controller the way nohup would: it outlives this process, like a batch job.

    It inherits fds 0-2: on the caller's pipes it would make `out=$(fsdpjob submit ...)` (or any captured
    run) wait for the whole job, so it gets /dev/null (the workers write to their own log files). And it
    inherits signal dispositions across exec: SIGHUP ignored, so closing the terminal does not kill the
    run. (An inherited SIG_IGN of SIGINT or SIGTERM does not matter: the supervisor sets its own handlers, and
    its children get the defaults back at exec.)
    """
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(fd) for fd in (0, 1, 2)]
    devnull = os.open(os.devnull, os.O_RDWR)
    in_main = threading.current_thread() is threading.main_thread()  # signal.signal works only there
    old_hup = signal.signal(signal.SIGHUP, signal.SIG_IGN) if in_main else None
    try:
        for fd in (0, 1, 2):
            os.dup2(devnull, fd)
        yield
    finally:
        if in_main:
            signal.signal(signal.SIGHUP, old_hup)
        for fd, copy in zip((0, 1, 2), saved):
            os.dup2(copy, fd)
            os.close(copy)
        os.close(devnull)


BACKEND = LocalBackend()
