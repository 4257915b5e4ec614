"""Training progress read from a run folder (metrics.jsonl, events.jsonl, checkpoints/): pure file reads."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from fsdpjob.orchestrator.core.runfolder import attempts, runlog
from fsdpjob.orchestrator.core.runfolder.ckptlayout import committed_steps
from fsdpjob.orchestrator.core.runfolder.runmeta import checkpoint_root


@dataclass
class Progress:
    step: int | None = None
    loss: float | None = None
    eval_loss: float | None = None  # the newest evaluation's (train.eval_every)
    reward: float | None = None  # grpo: the newest logged step's mean reward
    eval_step: int | None = None
    tokens_per_s: float | None = None
    eta_s: float | None = None
    last_checkpoint_step: int | None = None
    starts: int = 0
    steps_lost: int = 0
    done: bool = False
    failure: str | None = None
    last_stop: dict | None = None
    last_resume: dict | None = None  # the newest resume event's tier and step
    data: dict | None = None  # the newest data event (the worker's table: examples, long-example policy counts)
    cancelled: bool = False  # `fsdpjob cancel` asked for it (its cancel event)
    faults: list[dict] = field(default_factory=list)  # the supervisor's fault events (crashes, hangs)
    events: list[dict] = field(default_factory=list)
    metrics: list[dict] = field(default_factory=list)  # the tail read (METRICS_TAIL_BYTES)

    relaunched_stops: int = 0  # stops the supervisor restarted in the allocation (srun's teardown), not requeued

    @property
    def restarts_in_allocation(self) -> int:
        """The supervisor's relaunches in the allocation: after a fault, or after a stop that was srun's teardown of
        the step (supervise/stopfinish.py restarts it rather than requeue)."""
        return sum(1 for f in self.faults if f.get("restart")) + self.relaunched_stops

    @property
    def restarts(self) -> int:
        """Scheduler restarts (requeues): starts beyond the first that the supervisor did not make."""
        return max(0, self.starts - 1 - self.restarts_in_allocation)

    def recovery(self) -> dict | None:
        """What the in-allocation supervisor did (status's ``recovery``); None when it never had to act."""
        if not self.faults:
            return None
        last = self.faults[-1]
        keys = ("kind", "reason", "ranks", "hosts", "top_frames", "stacks", "decision", "launch", "time")
        excluded = sorted({h for f in self.faults for h in f.get("exclude") or ()})
        return {"restarts": self.restarts_in_allocation, "faults": len(self.faults),
                "last_fault": {k: last.get(k) for k in keys if last.get(k) is not None}, "excluded_nodes": excluded,
                # Which checkpoint tier (memory, durable) and step the newest start resumed from.
                "last_resume": self.last_resume}


# How much of each file's end status reads: enough for the newest values on a long run.
METRICS_TAIL_BYTES, EVENTS_TAIL_BYTES = 65536, 1 << 20


def read_progress(run_dir: Path, checkpoints_dir: Path | None = None) -> Progress:
    prog = Progress()
    metrics = runlog.read_metrics(run_dir, METRICS_TAIL_BYTES)
    # Evaluations have lines of their own (eval_loss, no loss): the newest of each kind.
    trained = [m for m in metrics if "eval_loss" not in m]
    if trained:
        last = trained[-1]
        prog.step, prog.loss = last.get("step"), last.get("loss")
        prog.tokens_per_s, prog.eta_s = last.get("tokens_per_s"), last.get("eta_s")
        prog.reward = last.get("reward")
    if evals := [m for m in metrics if "eval_loss" in m]:
        prog.eval_loss, prog.eval_step = evals[-1].get("eval_loss"), evals[-1].get("step")
    events = runlog.read_events(run_dir, EVENTS_TAIL_BYTES)
    prog.events, prog.metrics = events, metrics
    # Metrics matter for steps lost only when the run started more than once; most runs did not.
    if not attempts.later_starts(events):
        metrics = []
    # Steps lost: work done in an attempt beyond the step the next attempt resumed from (time-ordered).
    reached, failed_step = 0, None
    for ev in runlog.merge(events, metrics):
        kind = ev.get("event")
        if kind == runlog.START:
            prog.starts += 1
            prog.done, prog.failure, failed_step = False, None, None
        elif kind in (runlog.RESUME, runlog.READY):
            if kind == runlog.RESUME:
                prog.last_resume = {"tier": ev.get("tier", "durable"), "step": ev.get("step")}
            # Where an attempt starts training: a resume's step, or 0 after a crash before any checkpoint.
            prog.steps_lost += max(0, reached - int(ev.get("step", 0)))
            reached = int(ev.get("step", 0))
        elif kind == runlog.DONE:
            prog.done = True
            prog.step = ev.get("step", prog.step)
        elif kind == runlog.FAILED:
            prog.failure = ev.get("reason") or ev.get("error")
            failed_step = ev.get("step") if isinstance(ev.get("step"), int) else None
        elif kind == runlog.STOP:
            prog.last_stop = ev
            prog.relaunched_stops += bool(ev.get("restarted"))
        elif kind == runlog.DATA:
            prog.data = ev
        elif kind == runlog.CANCEL:
            prog.cancelled = True
        elif kind == runlog.FAULT:
            prog.faults.append(ev)
        if kind in (runlog.STOP, runlog.CHECKPOINT, runlog.METRIC, runlog.FAILED, runlog.REQUEUE) and isinstance(
            ev.get("step"), int
        ):
            # Failure events carry the step a crash reached: older metrics may be past the tail read.
            reached = max(reached, ev["step"])
    if prog.failure is not None and failed_step is not None:
        prog.step = failed_step  # the step the last attempt's crash reached, logged or not (log_every)
    steps = committed_steps(checkpoints_dir or checkpoint_root(run_dir))  # honours checkpoint.dir
    prog.last_checkpoint_step = steps[-1][0] if steps else None
    return prog
