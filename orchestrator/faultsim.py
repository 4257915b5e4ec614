"""The scale picture, by simulation (issue 27 part 6): replay synthetic fault traces against fsdpjob's own recovery
policy and report goodput (useful training time / wall time) with the durable checkpoint only, the memory tier
only, or both. Pure and torch-free: a seed in, numbers out (`bench/fault_sim.py` prints the table).

What is fsdpjob's own, imported rather than re-implemented:
- restart or give up after each fault: supervise/policy.restart_in_allocation (the restart budget
  recovery.max_restarts, "two restarts without a new checkpoint", a node blamed twice or lost, min_nodes);
- how long a hang goes unnoticed: supervise/stall.Watch, fed the heartbeats of a run that stops advancing;
- how long a lost node takes to be found: supervise/allocation.PROBE_TIMEOUT_S;
- the requeue cap: core/attempts.cap_reached with preemption.max_requeues;
- the defaults (max_restarts, stall bounds, max_requeues, the durable interval) from core/jobspec/spec.py's models;
- the Young/Daly optimum of the durable interval: planner/interval.advise.

What is modelled (and where it is optimistic or not):
- faults arrive as a Poisson process per node in use (rates per node-day, `Rates`); one trace per seed, shared
  by the three tiers (common random numbers), faults during a recovery are dropped (optimistic);
- training progresses at (nodes in use / nodes) of the full speed; every save blocks the loop for its stall
  (durable: what async staging cannot overlap; memory: the snapshot copy), at fixed wall-time intervals;
- a crash or hang restarts in the allocation (when the policy says so) from the newest complete tier: memory
  when on, else the newest durable checkpoint; a lost node kills its memory copy, its buddy's replica survives
  with probability ``replica_survival`` (used only when the run goes on in the allocation: min_nodes < nodes);
- giving up, a lost node with min_nodes = nodes, or a warned preemption or time limit (a stop checkpoint first:
  nothing lost) requeue the job: a new allocation on other nodes after ``requeue_s``, from the durable tier only
  (the issue's rule: requeues use the durable tier). With periodic durable saves off ("memory" alone) that is
  the last stop checkpoint;
- the queue wait of a requeue beyond Slurm's hold is not modelled (site-dependent): ``requeue_s`` is the floor,
  and the partition always has spare nodes (a requeue can exclude a lost node);
- a shrunk world is assumed to keep the global batch (the worker refuses one that does not divide it).
"""

from __future__ import annotations

import functools
import math
import random
from dataclasses import dataclass, field, replace

from fsdpjob.orchestrator.core.jobspec.spec import CheckpointSpec, PreemptionSpec, RecoverySpec
from fsdpjob.orchestrator.core.runfolder import memtier
from fsdpjob.orchestrator.core.runfolder.attempts import cap_reached
from fsdpjob.orchestrator.core.runfolder.heartbeat import STEP, Beat
from fsdpjob.orchestrator.planner import interval
from fsdpjob.orchestrator.supervise.allocation import PROBE_TIMEOUT_S
from fsdpjob.orchestrator.supervise.policy import Fault, restart_in_allocation
from fsdpjob.orchestrator.supervise.stall import Bounds, Watch

DAY_S = 86400.0
KINDS = ("crash", "hang", "node_loss", "preempt")
TIERS = ("durable", "memory", "both")

# Llama 3 405B on 16,384 H100 (2,048 nodes of 8), 54 days: 419 unexpected interruptions, ~78% hardware, and 47
# planned ones (Meta, "The Llama 3 Herd of Models", arXiv 2407.21783, section 3.3.4 and Table 5; reported by
# datacenterdynamics.com). Per node-day: 419 / (54 x 2048) = 3.79e-3 unexpected, 47 / (54 x 2048) = 4.25e-4 planned.
LLAMA3_UNEXPECTED_PER_NODE_DAY = 419 / (54 * 2048)
LLAMA3_PLANNED_PER_NODE_DAY = 47 / (54 * 2048)
LLAMA3_HARDWARE_SHARE = 0.78


@dataclass(frozen=True)
class Rates:
    """Faults per node-day. Defaults: Llama 3's figures, with hardware faults taken as a lost node (the node is
    drained and replaced) and the other 22% split 2:1 between crashes and hangs (an assumption: Llama 3
    publishes no hang share; NCCL watchdog timeouts are one of its small categories). DLRover reports the other
    view, "about 75% of the faults could be recovered by restarting the training process": set node_loss
    lower and crash higher to see it."""

    crash: float = LLAMA3_UNEXPECTED_PER_NODE_DAY * (1 - LLAMA3_HARDWARE_SHARE) * 2 / 3
    hang: float = LLAMA3_UNEXPECTED_PER_NODE_DAY * (1 - LLAMA3_HARDWARE_SHARE) / 3
    node_loss: float = LLAMA3_UNEXPECTED_PER_NODE_DAY * LLAMA3_HARDWARE_SHARE
    preempt: float = LLAMA3_PLANNED_PER_NODE_DAY  # planned maintenance: a preemption with its warning signal

    @classmethod
    def with_node_loss_share(cls, share: float) -> Rates:
        """Llama 3's unexpected rate with ``share`` of it lost nodes, the rest crashes and hangs 2:1."""
        rest = LLAMA3_UNEXPECTED_PER_NODE_DAY * (1 - share)
        return cls(crash=rest * 2 / 3, hang=rest / 3, node_loss=LLAMA3_UNEXPECTED_PER_NODE_DAY * share)

    def total(self) -> float:
        return self.crash + self.hang + self.node_loss + self.preempt

    def scaled(self, factor: float) -> Rates:
        return Rates(*(factor * getattr(self, k) for k in KINDS))


@dataclass(frozen=True)
class SimConfig:
    """One job. Times in seconds. The policy defaults come from the spec models; the rest are inputs whose
    defaults are stated assumptions (bench/RESULTS.md lists them with the figures)."""

    gpus: int
    gpus_per_node: int = 8
    step_s: float = 5.0  # one training step at scale (assumption)
    horizon_days: float = 7.0
    rates: Rates = field(default_factory=Rates)
    # Durable tier: checkpoint.interval_minutes' default; the stall is what async staging cannot overlap.
    durable_interval_s: float = CheckpointSpec.model_fields["interval_minutes"].default * 60.0
    durable_stall_s: float = 5.0
    durable_load_s: float = 60.0  # read the newest durable checkpoint back (all ranks, shared storage)
    stop_save_s: float = 60.0  # a stop checkpoint (blocking) at a warned preemption or the time limit
    # Memory tier (issue 27 parts 1-3): snapshot every memory_interval_steps steps.
    memory_interval_steps: int = 10  # DLRover's flash checkpoint saves in memory every 10 steps
    memory_stall_s: float = 0.2  # DLRover: ~0.2 s stall at 1,536 GPUs
    memory_restore_s: float = 5.0
    replica_survival: float = 1.0  # one lost node: its buddy's replica of its shards is on another node
    # Recovery and the queue.
    crash_detect_s: float = 2.0  # srun ends the step within a second or two of a rank's death
    relaunch_s: float = 20.0  # new srun step to the first step, without the load (~22 s measured with a tiny one)
    requeue_s: float = 180.0  # Slurm's ~120 s hold of a requeued job plus its start; no queue wait
    time_limit_h: float = 24.0  # each allocation ends with a stop checkpoint and a requeue; 0: none
    max_restarts: int = RecoverySpec.model_fields["max_restarts"].default
    stall_floor_s: float = RecoverySpec.model_fields["stall_floor_s"].default
    stall_factor: float = RecoverySpec.model_fields["stall_factor"].default
    max_requeues: int = PreemptionSpec.model_fields["max_requeues"].default
    min_nodes: int | None = None  # resources.min_nodes; None: nodes (the default: never shrink)

    @property
    def nodes(self) -> int:
        return max(1, self.gpus // self.gpus_per_node)

    @property
    def memory_interval_s(self) -> float:
        return self.memory_interval_steps * self.step_s


@dataclass(frozen=True)
class TraceEvent:
    time: float
    kind: str
    slot: int  # which of the job's node positions it hits


@dataclass
class Outcome:
    tier: str
    goodput: float  # useful training seconds (full-job speed) / wall seconds
    faults: int = 0  # faults that hit the job (outside recoveries)
    restarts: int = 0  # in-allocation restarts
    requeues: int = 0  # new allocations (failures, lost nodes, preemptions, time limits)
    cap_day: float | None = None  # when preemption.max_requeues would have ended the run (FAILED), if it did
    lost_s: float = 0.0  # training seconds redone
    stall_s: float = 0.0  # wall seconds spent in saves (periodic and stop checkpoints)
    recovery_s: float = 0.0  # wall seconds from faults to training again (detection, relaunch, load, queue)


def trace(cfg: SimConfig, seed: int) -> list[TraceEvent]:
    """A fault trace for the job's node positions over the horizon: Poisson arrivals at the total rate,
    each a kind in proportion to its rate, on a uniformly drawn position."""
    rng = random.Random(seed)
    per_s = cfg.rates.total() * cfg.nodes / DAY_S
    weights = [getattr(cfg.rates, k) for k in KINDS]
    events, t, end = [], 0.0, cfg.horizon_days * DAY_S
    while per_s > 0:
        t += rng.expovariate(per_s)
        if t >= end:
            break
        events.append(TraceEvent(t, rng.choices(KINDS, weights)[0], rng.randrange(cfg.nodes)))
    return events


def hang_detection_s(cfg: SimConfig) -> float:
    """Seconds from a hang to the supervisor's verdict: supervise/stall.Watch fed the heartbeats (one a second)
    of a rank that trains steps of ``step_s`` and then stops advancing, its heartbeat thread still running."""
    return _hang_detection_s(cfg.step_s, cfg.stall_floor_s, cfg.stall_factor)


@functools.lru_cache(maxsize=64)
def _hang_detection_s(step_s: float, floor_s: float, factor: float) -> float:
    watch = Watch(world_size=1, started=0.0, bounds=Bounds(setup_s=900.0, floor_s=floor_s, factor=factor))
    steps, now = 60, 0.0
    while True:
        now += 1.0
        step = min(int(now / step_s), steps)
        beat = Beat(rank=0, host="n1", machine="n1", pid=1, launch=0, step=step, phase=STEP,
                    phase_since=step * step_s, time=now)
        if watch.observe([beat], now) is not None:
            return now - steps * step_s
        if now > steps * step_s + 100 * 3600:
            raise RuntimeError("the watch never called the hang")  # a broken bound, not a slow one


def _saves(x: float, every: float | None) -> int:
    return int(x // every) if every else 0


@dataclass
class _Alloc:
    faults: list[Fault] = field(default_factory=list)
    excluded: set[str] = field(default_factory=set)
    gone: set[int] = field(default_factory=set)  # positions whose node was lost or given up on: refilled at a requeue
    launch: int = 0
    start: float = 0.0


def simulate(cfg: SimConfig, tier: str, events: list[TraceEvent], seed: int = 0) -> Outcome:
    """Replay ``events`` for one tier ("durable", "memory" or "both")."""
    if tier not in TIERS:
        raise ValueError(f"unknown tier {tier!r}; known: {', '.join(TIERS)}")
    replay = _Replay(cfg, tier, seed)
    end = cfg.horizon_days * DAY_S
    limit = cfg.time_limit_h * 3600.0 or math.inf
    seg_start, pending = 0.0, list(reversed(events))
    while True:
        replay.drop_unseen(pending, seg_start)
        fault = pending[-1] if pending else None
        stop_at = min(fault.time if fault else math.inf, replay.alloc.start + limit, end)
        trained = replay.train(stop_at - seg_start)
        if stop_at >= end:
            break
        if fault is None or stop_at < fault.time or fault.kind == "preempt":
            if fault is not None and stop_at == fault.time:  # a warned preemption
                pending.pop()
                replay.out.faults += 1
            seg_start = replay.stop(stop_at)
            continue
        pending.pop()
        replay.out.faults += 1
        seg_start = replay.recover(fault, trained)
    replay.out.goodput = replay.work / end
    return replay.out


class _Replay:
    """One tier's run through a trace: its allocation, and the training seconds (at full speed) done and
    restorable from each tier."""

    def __init__(self, cfg: SimConfig, tier: str, seed: int):
        self.cfg = cfg
        self.every_d = cfg.durable_interval_s if tier in ("durable", "both") else None
        self.every_m = cfg.memory_interval_s if tier in ("memory", "both") else None
        self.rng = random.Random(seed * 7919 + 1)  # replica survival draws
        self.detect = {"crash": cfg.crash_detect_s, "hang": hang_detection_s(cfg),
                       "node_loss": cfg.crash_detect_s + PROBE_TIMEOUT_S}
        self.out = Outcome(tier=tier, goodput=0.0)
        self.generation = [0] * cfg.nodes  # a lost node's position is refilled by another node at the next allocation
        self.alloc = _Alloc()
        self.work = self.ckpt_d = self.ckpt_m = 0.0
        self.streak = 0  # requeues in a row that signal a broken job (the cap counts these)
        self.ckpt_at_alloc = 0.0  # the durable checkpoint this allocation started from

    def name(self, slot: int) -> str:
        return f"n{slot}.{self.generation[slot]}"

    def drop_unseen(self, pending: list[TraceEvent], seg_start: float) -> None:
        """Drop the faults during a recovery, or on a node this allocation left out (``pending``: newest first)."""
        while pending and (pending[-1].time < seg_start or self.name(pending[-1].slot) in self.alloc.excluded):
            pending.pop()

    def train(self, elapsed: float) -> float:
        """Train for ``elapsed`` wall seconds on the allocation's nodes, saving each tier at its interval; the
        training seconds this segment added."""
        cfg, every_d, every_m = self.cfg, self.every_d, self.every_m
        stall_d, stall_m = cfg.durable_stall_s, cfg.memory_stall_s
        base, speed = self.work, (cfg.nodes - len(self.alloc.excluded)) / cfg.nodes

        def work_at(x: float) -> float:
            return base + speed * (x - _saves(x, every_d) * stall_d - _saves(x, every_m) * stall_m)

        self.work = work_at(elapsed)
        self.out.stall_s += _saves(elapsed, every_d) * stall_d + _saves(elapsed, every_m) * stall_m
        if (n := _saves(elapsed, every_d)) > 0:
            self.ckpt_d = max(self.ckpt_d, work_at(n * every_d))
        if (n := _saves(elapsed, every_m)) > 0:
            self.ckpt_m = max(self.ckpt_m, work_at(n * every_m))
        self.ckpt_m = max(self.ckpt_m, self.ckpt_d)
        return self.work - base

    def stop(self, at: float) -> float:
        """The time limit or a warned preemption: a stop checkpoint (nothing lost), then a requeue. When
        training goes on."""
        self.out.stall_s += self.cfg.stop_save_s
        self.ckpt_d = self.work
        start = self.requeue(at + self.cfg.stop_save_s, healthy=True)
        self.out.recovery_s += start - at - self.cfg.stop_save_s
        return start

    def recover(self, fault: TraceEvent, trained: float) -> float:
        """A crash, hang or lost node: the supervisor's policy restarts in the allocation or gives up (a
        requeue). When training goes on."""
        cfg, alloc, host = self.cfg, self.alloc, self.name(fault.slot)
        restorable = self.ckpt_m if self.every_m else self.ckpt_d
        alloc.faults.append(Fault(kind="hang" if fault.kind == "hang" else "crash", launch=alloc.launch,
                                  committed=int(restorable / cfg.step_s), hosts=(host,),
                                  trained=int(trained / cfg.step_s)))
        decision = restart_in_allocation(alloc.faults, [], max_restarts=cfg.max_restarts, ever_trained=True,
                                         can_exclude=True, dead=(host,) if fault.kind == "node_loss" else (),
                                         excluded=tuple(sorted(alloc.excluded)), nodes=cfg.nodes,
                                         min_nodes=cfg.min_nodes or cfg.nodes, requeue_refuses=lambda _: None)
        detected = fault.time + self.detect[fault.kind]
        alloc.gone |= {slot for slot in range(cfg.nodes) if self.name(slot) in decision.exclude}
        if decision.restart:
            alloc.excluded |= set(decision.exclude)
            start = detected + cfg.relaunch_s + self.restore(fault)
            alloc.launch += 1
            self.out.restarts += 1
        else:
            self.out.lost_s += self.work - self.ckpt_d
            start = self.requeue(detected, healthy=self.ckpt_d > self.ckpt_at_alloc)  # kept progress, or not
        self.out.recovery_s += start - fault.time
        return start

    def restore(self, fault: TraceEvent) -> float:
        """Restart in the allocation from the newest complete tier: memory (a lost node's shards from its
        buddy's replica) or durable. The load's seconds."""
        cfg = self.cfg
        memory_ok = self.every_m is not None and (fault.kind != "node_loss" or self.rng.random() < cfg.replica_survival)
        resume, load = (self.ckpt_m, cfg.memory_restore_s) if memory_ok else (self.ckpt_d, cfg.durable_load_s)
        self.out.lost_s += self.work - resume
        self.work, self.ckpt_m = resume, max(resume, self.ckpt_d)
        return load

    def requeue(self, at: float, healthy: bool = False) -> float:
        """A new allocation on other nodes, from the durable tier only. When it starts training."""
        cfg, out = self.cfg, self.out
        # Only requeues that signal a broken job count against the cap (core/attempts.unhealthy_streak): an
        # allocation that kept no progress; a stop checkpoint or a committed save after progress ends the streak.
        self.streak = 0 if healthy else self.streak + 1
        if out.cap_day is None and cap_reached(self.streak, cfg.max_requeues):
            out.cap_day = at / DAY_S  # the failure policy would have failed the run here; we go on as if resubmitted
        out.requeues += 1
        for slot in self.alloc.gone:
            self.generation[slot] += 1  # Slurm's exclude list: the new allocation has another node there
        self.work = self.ckpt_m = self.ckpt_at_alloc = self.ckpt_d
        self.alloc = _Alloc(start=at + cfg.requeue_s + cfg.relaunch_s + cfg.durable_load_s)
        return self.alloc.start


def run(cfg: SimConfig, seeds: int = 20, seed: int = 0, tiers: tuple[str, ...] = TIERS) -> dict[str, Outcome]:
    """Mean outcome per tier over ``seeds`` traces (the same traces for every tier)."""
    totals: dict[str, list[Outcome]] = {t: [] for t in tiers}
    for i in range(seeds):
        events = trace(cfg, seed * 100003 + i)
        for t in tiers:
            totals[t].append(simulate(cfg, t, events, seed=seed * 100003 + i))
    return {t: _mean(t, outs) for t, outs in totals.items()}


def _mean(tier: str, outs: list[Outcome]) -> Outcome:
    n = len(outs)
    caps = [o.cap_day for o in outs if o.cap_day is not None]
    return Outcome(tier=tier, goodput=sum(o.goodput for o in outs) / n, faults=round(sum(o.faults for o in outs) / n),
                   restarts=round(sum(o.restarts for o in outs) / n), requeues=round(sum(o.requeues for o in outs) / n),
                   cap_day=(sorted(caps)[len(caps) // 2] if len(caps) * 2 > n else None),
                   lost_s=sum(o.lost_s for o in outs) / n, stall_s=sum(o.stall_s for o in outs) / n,
                   recovery_s=sum(o.recovery_s for o in outs) / n)


def durable_advice(cfg: SimConfig) -> interval.IntervalAdvice:
    """planner/interval's Young/Daly advice for the durable interval, against the faults that lose work."""
    lose = cfg.rates.crash + cfg.rates.hang + cfg.rates.node_loss
    mtbi = DAY_S / (lose * cfg.nodes) if lose else math.inf
    return interval.advise(cfg.durable_stall_s, mtbi, cfg.durable_interval_s, "interval_minutes default")


def auto_memory_interval_steps(cfg: SimConfig) -> int:
    """checkpoint.memory_interval_steps: auto, the worker's rule (core/memtier.auto_interval) with the simulated
    snapshot stall and the mean time between the faults the memory tier recovers (crashes and hangs; lost nodes
    too where the run may go on without a node)."""
    shrinks = (cfg.min_nodes or cfg.nodes) < cfg.nodes
    covered = cfg.rates.crash + cfg.rates.hang + (cfg.rates.node_loss if shrinks else 0)
    if not covered:  # a simulated fleet without such faults (the worker, without a rate, takes the stall bound)
        return 10**9
    return memtier.auto_interval(cfg.memory_stall_s, cfg.step_s, memtier.mtbi_s(covered, cfg.nodes)).steps


def with_rates(cfg: SimConfig, factor: float) -> SimConfig:
    return replace(cfg, rates=cfg.rates.scaled(factor))
