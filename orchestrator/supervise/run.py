"""The in-allocation supervisor: runs the workers' step as its child, watches it, and restarts it here.

    python -m fsdpjob.orchestrator.supervise RUN_DIR --world-size N [--scheduler slurm|local] -- COMMAND...

On Slurm, COMMAND is the batch script's ``srun ...`` line and this runs in the batch step on the first node;
locally it is submitit's controller. No torch here: it must start in milliseconds and survive what it watches.

One launch at a time: clear the heartbeats, start COMMAND (env FSDPJOB_LAUNCH=<n>), then once a second read
the heartbeats (stall.py). The launch ends by itself (exit 0: done, or a stop checkpoint the workers handed
over, core/runfolder/stophandoff.py; non-zero: a crash) or by a stall verdict: every rank's stacks are dumped
(stacks.py), then the step gets SIGTERM, a short grace, and a hard kill. A hand-off ends the loop: the
allocation asks Slurm what the stop was and requeues the job (slurm/stop.py), and records it (stopfinish.py);
the workers run no Slurm command. A crash or a stall is a ``fault`` event; policy.py then says restart (a new
launch, same allocation, resuming from the newest committed checkpoint) or give up (this exits non-zero and the
batch script's failure policy requeues or fails the job as before).
A SIGTERM or SIGINT to the supervisor (scancel, a requeue, `fsdpjob cancel` locally) is passed on and ends it.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from fsdpjob.orchestrator.core import buildid, rendezvous
from fsdpjob.orchestrator.core.genserver import handover
from fsdpjob.orchestrator.core.jobspec.spec import JobSpec
from fsdpjob.orchestrator.core.runfolder import attempts, heartbeat, memtier, runlog, stophandoff
from fsdpjob.orchestrator.core.runfolder.ckptlayout import committed_steps
from fsdpjob.orchestrator.core.runfolder.runmeta import RunMeta, checkpoint_root
from fsdpjob.orchestrator.core.runfolder.taskexit import read_task_exits

from . import notifier, stacks
from .allocation import NodeFacts, allocation_for
from .blame import blame_crash, srun_task_exit
from .genserver import ServerDown, generation_server
from .policy import Fault, restart_in_allocation
from .stall import Bounds, Verdict, Watch

POLL_S = 1.0
TERM_GRACE_S = 3.0  # after SIGTERM, before the hard kill: the ranks are stuck, a save cannot happen anyway
# After a rank died its peers fail at once (their sockets close with it) and can save nothing: their error
# events are written within this; ranks that still linger (a destroy blocked on a peer) are killed.
CRASH_GRACE_S = 1.0
# Where the step ends itself on a rank's bad exit (srun's --kill-on-bad-exit), the supervisor leaves it this long
# before signalling: it may see a rank's process gone (a zombie) before its runtime and task shell have reaped
# it, and a SIGTERM then would end every other worker by its handler, each recorded by its shell (taskexit.py)
# before the dead one's; srun's own teardown SIGKILLs the others, shells included, after the dead one's record.
SELF_END_S = 3.0
KILL_WAIT_S = 15.0
SERVER_LOST_MARGIN_S = 60.0  # after a request deadline: the rank's report, the supervisor's next look, a busy machine


class Supervisor:
    def __init__(self, run_dir: Path, command: list[str], *, world_size: int, scheduler: str):
        self.run_dir, self.command, self.world_size = run_dir, command, world_size
        meta = RunMeta.read(run_dir)
        spec = JobSpec.model_validate(meta.spec)
        self.recovery = spec.recovery
        self.planned = meta.worker_facts  # the plan's step and save times bound what nothing measured yet
        # The workers' folder, as the profile's env and the spec's over it hand it to them (not this process's
        # environment, which a local run does not share with its workers).
        workers_env = memtier.workers_env(meta.profile.get("env") or {}, spec.env)
        self.memory_tier = memtier.job_base(spec.checkpoint.memory_interval_steps, workers_env)
        self.max_requeues = spec.preemption.max_requeues
        # Slurm's node count of this allocation; the step may shrink to min_nodes when a node is lost.
        self.allocation = allocation_for(scheduler)
        self.nodes = self.allocation.nodes
        self.worker_env = self.allocation.worker_env()  # resolved once: the nodes stay those of the allocation
        self.min_nodes = min(self.nodes, spec.resources.min_nodes or self.nodes)
        self.tasks_per_node = max(1, world_size // self.nodes)
        self.excluded: tuple[str, ...] = ()
        self.job_id = self.allocation.job_id
        self.proc: subprocess.Popen | None = None
        self.signalled: int = 0
        self.faults: list[Fault] = []
        self._launch_took: list[float] = []  # per launch in this allocation: seconds until every rank reported
        self._gather = ThreadPoolExecutor(max_workers=1, thread_name_prefix="node-facts")
        self.server, self.server_nodes = generation_server(spec, self.run_dir, self.allocation, self.worker_env)
        # A round on the server may wait out its request deadline before a rank reports it lost (stall.py).
        self.generation_wait_s = (spec.grpo.generator.deadline_s + SERVER_LOST_MARGIN_S) if self.server else 0.0

    # -- the loop --------------------------------------------------------------------------------
    def run(self) -> int:
        try:
            return self._run()
        finally:
            # The memory tier serves restarts in this allocation only (a requeue resumes from the durable tier):
            # whatever ended the loop, it goes, from every node. The workers of a completed run removed theirs
            # already; this covers the crashes given up on and the stops. This host's first (a node folder per
            # emulated node on a dev cluster), then the others through the allocation.
            if self.server is not None:
                self.server.stop()
            if self.memory_tier and self.job_id:
                memtier.remove_job(self.memory_tier, self.job_id)
                if self.nodes > 1:
                    self.allocation.remove_on_nodes(Path(self.memory_tier) / self.job_id)

    def _run(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        self._make_written_folders()
        launch = 0
        while True:
            started = time.time()
            rc, verdict = self._launch(launch, started)
            if (handoff := stophandoff.take(self.run_dir, launch)) is not None:
                # The workers committed a stop checkpoint and left (preemption, time limit, a requeue or a
                # cancel): this side asks Slurm which, and requeues; whatever rc srun's teardown gave. A SIGTERM
                # of srun's teardown (slurm/stop.py: teardown) restarts the workers here instead, within the budget.
                ended = self.allocation.finish_stop(self.run_dir, handoff, self.max_requeues,
                                                    signalled=bool(self.signalled),
                                                    restart_here=self._teardown_restart(handoff.step))
                if ended is not None:
                    return ended
                self.faults.append(Fault("teardown", launch, handoff.step, ()))
                launch += 1
                self._wait_gpus_free(launch)
                continue
            if self.signalled or (rc == 0 and verdict is None):
                return rc
            if self._finished_since(started):
                # A signal that lands after the last rank wrote "done" (e.g. the time limit's warning during
                # teardown) fails the step's exit code, not the run; so does a stall of ranks that exit slowly
                # after it (seen on a loaded machine: every rank 'exited' at the last step for 11 s). Restarting
                # would only find it finished, and giving up would have the failure policy requeue it.
                late = f"a {verdict.kind} ({verdict.reason})" if verdict else f"the step's exit code {rc}"
                print(f"fsdpjob supervisor: the run finished; {late} came at teardown", file=sys.stderr, flush=True)
                return 0
            if self._record(launch, started, rc, verdict).restart:
                launch += 1
                self._wait_gpus_free(launch)
                continue
            return rc if rc != 0 else 1

    def _make_written_folders(self) -> None:
        """Every folder the workers write exists before the first launch: a container runtime refuses to mount a
        missing source (bwrap: "Can't find source path", enroot alike), and the run would end as a failure that
        "would fail the same way again". The checkpoint root on the shared file system; the memory tier's folder
        on every node (node-local)."""
        checkpoint_root(self.run_dir).mkdir(parents=True, exist_ok=True)
        if self.memory_tier:
            Path(self.memory_tier).mkdir(parents=True, exist_ok=True)
            if self.nodes > 1:
                self.allocation.make_on_nodes(Path(self.memory_tier))

    def _launch(self, launch: int, started: float) -> tuple[int, Verdict | None]:
        self._gone: tuple[int, ...] = ()
        self._crash_seen_at: float | None = None
        self._signalled_at: float | None = None
        self._node_facts: Future[NodeFacts] | None = None
        shutil.rmtree(heartbeat.heartbeat_dir(self.run_dir), ignore_errors=True)
        # The tasks' shells write their exits there (taskexit.py), a rank that dies before its heartbeat too.
        heartbeat.heartbeat_dir(self.run_dir).mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **self.worker_env, "FSDPJOB_LAUNCH": str(launch), "FSDPJOB_SUPERVISED": "1",
               "FSDPJOB_HOST_BUILD": buildid.build_id(),
               # Drawn for each launch, free on this node (rank 0's unless it was excluded): core/rendezvous.py.
               rendezvous.MASTER_PORT_VAR: str(rendezvous.pick_port())}
        if self.server is not None:  # grpo's generation server, up and answering before the workers start
            self._server_env = env
            try:
                env["FSDPJOB_GENERATION_SERVER"] = self._start_server(env, launch)
            except ServerDown as exc:
                return 1, self._server_down(exc)
        # Its own process group: a stall ends the whole local tree (controller and ranks) in one signal.
        # srun's stderr passes through here: its task reports name the rank that failed first (blame.py).
        srun = self.allocation.srun_reports
        self.proc = subprocess.Popen(self._command(), env=env, start_new_session=True,
                                     stderr=subprocess.PIPE if srun else None)
        self._srun_exits: list[tuple[tuple[int, ...], str]] = []
        self._srun_untouched: int | None = None  # how many of them srun printed before the supervisor's signal
        self._relay = (threading.Thread(target=self._relay_stderr, args=(self.proc.stderr,), daemon=True)
                       if srun else None)
        if self._relay is not None:
            self._relay.start()
        world = (self.nodes - len(self.excluded) - len(self.server_nodes)) * self.tasks_per_node
        watch = Watch(world, started, Bounds(self._setup_bound(), self.recovery.stall_floor_s,
                                             self.recovery.stall_factor, self.planned.get("planned_step_s"),
                                             self.planned.get("planned_save_s"), self._launch_bound(launch),
                                             self.generation_wait_s))
        try:
            return self._watch(watch, launch)
        finally:
            if (took := watch.launch_took()) is not None:
                self._launch_took.append(took)

    def _watch(self, watch: Watch, launch: int) -> tuple[int, Verdict | None]:
        while self.proc.poll() is None and not self.signalled:
            time.sleep(POLL_S)
            beats = heartbeat.read_beats(self.run_dir, launch)
            dead = _dead(beats)
            if dead:  # srun's --kill-on-bad-exit ends a Slurm step itself; a local controller waits for all
                self._gone = tuple(b.rank for b in dead)
                self._crash_seen_at = time.time()
                print(f"fsdpjob supervisor: rank(s) {[b.rank for b in dead]} exited; ending the step",
                      file=sys.stderr, flush=True)
                # The node probes and the partition query run while the step is torn down, not after it.
                self._node_facts = self._gather.submit(self.allocation.node_facts, self.excluded)
                if self.allocation.ends_step_on_bad_exit:
                    try:
                        return self.proc.wait(SELF_END_S) or 1, None
                    except subprocess.TimeoutExpired:
                        pass
                return self._end_step(CRASH_GRACE_S) or 1, None
            if self.server is not None and (why := self.server.lost()) is not None:
                if (down := self._replace_server(why, launch)) is not None:
                    return self._end_step(), down
                watch.excuse(time.time())  # the ranks waited on the generator: no stall of theirs
                continue
            verdict = watch.observe(beats, time.time())
            if verdict is not None and self.proc.poll() is None:
                self._stall(verdict, beats, launch)
                return self._end_step(), verdict
        return self.proc.wait(), None

    def _relay_stderr(self, stream) -> None:
        for line in iter(stream.readline, b""):
            try:
                sys.stderr.buffer.write(line)
                sys.stderr.flush()
            except (OSError, ValueError):
                pass  # no log to pass it to: keep reading, or srun would block on a full pipe
            if (report := srun_task_exit(line.decode("utf-8", errors="replace"))) is not None:
                self._srun_exits.append(report)

    def _command(self) -> list[str]:
        """The step's command; after nodes were lost (or beside a generation server), the allocation's launch on the
        ones left."""
        return self.allocation.step_command(self.command, (*self.excluded, *self.server_nodes), self.nodes,
                                            self.tasks_per_node)

    def _start_server(self, env: dict[str, str], launch: int) -> str:
        """A new generation server for every launch (a restart after a fault never reuses one that may be the
        fault), its address for the workers."""
        handover.clear(self.run_dir)
        self.server.start(env)
        self.server.replaced = 0
        address = self.server.wait_ready(self._launch_bound(launch))
        handover.write_address(self.run_dir, address, self.server.starts)
        runlog.append(self.run_dir, runlog.SERVER, phase="ready", address=address, nodes=list(self.server_nodes),
                      start=self.server.starts)
        return address

    def _replace_server(self, why: str, launch: int) -> Verdict | None:
        """Generator-only recovery (genserver.py): a new server in place of a lost one while the training step
        waits; a Verdict (the step ends, a fault) if that fails."""
        detected = time.time()
        print(f"fsdpjob supervisor: generation server lost ({why}); replacing it", file=sys.stderr, flush=True)
        try:
            version = self.server.replace(self._server_env, self._launch_bound(launch), self.recovery.max_restarts,
                                          lambda: bool(self.signalled))
        except ServerDown as exc:
            return self._server_down(exc)
        runlog.append(self.run_dir, runlog.SERVER, phase="replaced", address=self.server.address,
                      nodes=list(self.server_nodes), start=self.server.starts, reason=why, version=version,
                      detected_at=detected, took_s=round(time.time() - detected, 1))
        return None

    def _server_down(self, exc: ServerDown) -> Verdict:
        self.server.stop()
        self._stall_info = {"reason": str(exc), "ranks": [], "detected_at": time.time(), "server": True}
        self._stall_hosts = self.server_nodes
        print(f"fsdpjob supervisor: {exc}", file=sys.stderr, flush=True)
        return Verdict("hang", (), f"generation server: {exc}", self.server.ready_bound_s)

    def _stall(self, verdict: Verdict, beats: list[heartbeat.Beat], launch: int) -> None:
        detected_at = time.time()
        out = stacks.stacks_dir(self.run_dir) / f"launch-{launch}-{int(detected_at)}"
        tops = stacks.dump_all(beats, out, job_id=self.job_id)
        self._stall_info = {"stacks": str(out), "top_frames": {str(r): t for r, t in tops.items()},
                            "ranks": list(verdict.ranks), "reason": verdict.reason,
                            "detected_after_s": round(verdict.waited_s, 1), "detected_at": detected_at}
        self._stall_hosts = tuple(sorted({b.host for b in beats if b.rank in verdict.ranks}))
        print(f"fsdpjob supervisor: {verdict.kind}: {verdict.reason}; stacks in {out}", file=sys.stderr, flush=True)

    def _end_step(self, grace_s: float = TERM_GRACE_S) -> int:
        """SIGTERM, a grace, then the allocation's hard kill (allocation.py)."""
        proc = self.proc
        if self._srun_untouched is None:
            # srun's reports from here on may be of the teardown this starts (blame.py). A line srun printed just
            # before and the relay thread has not read yet counts as after: the errors, heartbeats and the ranks
            # seen gone are weighed before it.
            self._srun_untouched = len(self._srun_exits)
            self._signalled_at = time.time()
        self._signal_group(signal.SIGTERM)
        try:
            return proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            pass
        self.allocation.kill_step(proc, self._signal_group)
        try:
            return proc.wait(KILL_WAIT_S)
        except subprocess.TimeoutExpired:
            self._signal_group(signal.SIGKILL)
            return proc.wait()

    def _signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def _on_signal(self, signum: int, _frame: object) -> None:
        """scancel, a requeue or `fsdpjob cancel`: pass it on to the step, never restart after it."""
        self.signalled = signum
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signum)

    # -- after a fault ---------------------------------------------------------------------------
    def _teardown_restart(self, step: int) -> str | None:
        """Why a stop on srun's teardown may restart the workers here (it then counts as a fault of the restart
        budget, recovery.max_restarts), or None where the budget is spent (the job is requeued as before)."""
        if len(self.faults) >= self.recovery.max_restarts:
            return None
        return (f"restarting the workers in this allocation from the stop checkpoint of step {step} "
                f"(restart {len(self.faults) + 1} of {self.recovery.max_restarts})")

    def _finished_since(self, started: float) -> bool:
        return runlog.first(runlog.since(runlog.timeline(self.run_dir), started), runlog.DONE) is not None

    def _record(self, launch: int, started: float, rc: int, verdict: Verdict | None):
        timeline = runlog.timeline(self.run_dir)
        since = runlog.since(timeline, started)
        committed = committed_steps(checkpoint_root(self.run_dir))
        beats = heartbeat.read_beats(self.run_dir, launch)
        if verdict is None:
            seen = self._crash_seen_at or time.time()
            # The rank that died first, not the peers that failed after it (blame.py).
            if self._relay is not None:
                self._relay.join(timeout=2.0)  # srun has exited: its last lines are on their way
            found = blame_crash(beats, since, self._gone, self._srun_exits, self._srun_untouched,
                                read_task_exits(self.run_dir, launch), self._signalled_at)
            kind, hosts = "crash", found.hosts
            info = {"reason": f"the workers' step exited {rc}", "detected_at": seen, "ranks": list(found.ranks),
                    "casualties": list(found.casualties), "exits": {str(r): w for r, w in found.exits.items()}}
        else:
            kind, info, hosts = verdict.kind, self._stall_info, self._stall_hosts
        # A crash probes the nodes (a lost one is left out); a stall named its node already.
        facts = (self._node_facts or self._gather.submit(self.allocation.node_facts, self.excluded)).result() \
            if kind == "crash" else None
        newest = committed[-1][0] if committed else None
        if self.memory_tier and self.job_id:
            # A snapshot of the memory tier is progress too: a restart resumes from it.
            in_memory = memtier.newest_committed(self.memory_tier, self.job_id)
            newest = max(newest or 0, in_memory) if in_memory is not None else newest
        self.faults.append(Fault(kind, launch, newest, hosts,
                                 trained=_trained(beats, since)))
        decision = restart_in_allocation(self.faults, since, max_restarts=self.recovery.max_restarts,
                                         ever_trained=attempts.ever_trained(timeline),
                                         can_exclude=self.allocation.can_exclude,
                                         dead=facts.lost if facts else (),
                                         excluded=self.excluded, nodes=self.nodes, min_nodes=self.min_nodes,
                                         requeue_refuses=(facts.requeue_refuses if facts
                                                          else self.allocation.requeue_refuses))
        if decision.restart and decision.exclude:
            self.excluded = tuple(sorted({*self.excluded, *decision.exclude}))
        runlog.append(self.run_dir, runlog.FAULT, kind=kind, launch=launch, exit_code=rc, hosts=list(hosts),
                      nodes_left=self.nodes - len(self.excluded),
                      restart=decision.restart, decision=decision.why, exclude=list(decision.exclude),
                      job_id=self.job_id or str(os.getpid()), step=self.faults[-1].committed, **info)
        print(f"fsdpjob supervisor: {kind} of launch {launch}: {decision.why}", file=sys.stderr, flush=True)
        return decision


    def _wait_gpus_free(self, launch: int) -> None:
        """The relaunch waits (bounded) until the crashed step's processes have let go of the GPUs: its own phase
        in the run's events, between the fault and the next start."""
        waited = self.allocation.wait_gpus_free(self.excluded)
        runlog.append(self.run_dir, runlog.GPU_WAIT, launch=launch, **waited.fields())
        if waited.busy:
            print(f"fsdpjob supervisor: GPUs still in use after {waited.waited_s:.0f} s ({waited.busy}); relaunching "
                  "anyway", file=sys.stderr, flush=True)
        if waited.no_gpus_seen:
            print(f"fsdpjob supervisor: the GPU-free probe saw no GPU on {', '.join(waited.no_gpus_seen)} (nvidia-smi: "
                  "No devices were found); relaunching without waiting for them", file=sys.stderr, flush=True)

    def _launch_bound(self, launch: int) -> float:
        """Until every rank reported: 3 x the longest launch measured in this allocation + 60 s. The allocation's
        first launch gets at least the first start's bound: on nodes a requeue brought, a container runtime may
        import the image again (minutes per node) before any rank starts, and killing that import would only
        start another (issue 36 item 3). recovery.setup_timeout_s set to a number bounds the launch too."""
        if self.recovery.setup_timeout_s != "auto":
            return float(self.recovery.setup_timeout_s)
        if not self._launch_took:
            return heartbeat.FIRST_SETUP_BOUND_S
        measured = 3 * max(self._launch_took) + 60
        return max(measured, heartbeat.FIRST_SETUP_BOUND_S) if launch == 0 else measured

    def _setup_bound(self) -> float:
        """recovery.setup_timeout_s, or from the previous attempt's setup (its ready event); a first start's from
        the plan's set-up work (the weights read, the data tokenized), at least the constant floor."""
        if self.recovery.setup_timeout_s != "auto":
            return float(self.recovery.setup_timeout_s)
        ready = [e for e in runlog.read_events(self.run_dir) if e.get("event") == runlog.READY]
        if not ready:
            return heartbeat.first_setup_bound_s(self.planned.get("planned_setup_s"))
        return 3 * float(ready[-1].get("setup_s") or 0) + 60


def _trained(beats: list[heartbeat.Beat], events: list[dict]) -> int:
    """Steps this launch trained: from its ready event's step to the furthest rank's heartbeat."""
    ready = next((e for e in events if e.get("event") == runlog.READY), None)
    if ready is None or not beats:
        return 0
    return max(0, max(b.step for b in beats) - int(ready.get("step") or 0))


def _dead(beats: list[heartbeat.Beat]) -> list[heartbeat.Beat]:
    """Ranks on this machine whose process is gone (or a zombie): a crash, whatever the others wait for."""
    here = os.uname().nodename
    dead = []
    for beat in beats:
        if beat.machine != here or beat.phase == heartbeat.EXITED:
            continue
        try:
            state = Path(f"/proc/{beat.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            state = "gone"
        if state in ("gone", "Z", "X"):
            dead.append(beat)
    return dead


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if "--" not in args:
        print("usage: python -m fsdpjob.orchestrator.supervise RUN_DIR --world-size N [--scheduler S] -- COMMAND...",
              file=sys.stderr)
        return 2
    split = args.index("--")
    parser = argparse.ArgumentParser(prog="fsdpjob.orchestrator.supervise")
    parser.add_argument("run_dir")
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--scheduler", choices=("slurm", "local"), default="slurm")
    opts = parser.parse_args(args[:split])
    supervisor = Supervisor(Path(opts.run_dir), args[split + 1:], world_size=opts.world_size, scheduler=opts.scheduler)
    # Webhooks (notifier.py): a thread here follows the run log and posts; the workers never do.
    told = notifier.start(Path(opts.run_dir))
    try:
        return supervisor.run()
    finally:
        if told is not None:
            told.close()
