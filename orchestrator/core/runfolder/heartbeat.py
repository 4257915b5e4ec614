"""Per-rank progress heartbeats: the worker writes them, the in-allocation supervisor reads them (stdlib only).

Each rank owns one small JSON file, ``<run>/heartbeat/rank-<R>.json``, rewritten atomically (write + rename)
by a daemon thread every ``HEARTBEAT_S`` seconds. The training loop only sets two attributes per step
(``beat.step``, ``beat.phase``), so the cost on the step is two stores; the file I/O happens on the thread.

Why a thread and not a write per step: a thread keeps beating while the main thread waits in a collective
(gloo and NCCL release the GIL), so the supervisor can tell a rank that is *frozen* (SIGSTOP, a stuck GIL:
its file stops changing) from a rank that is *waiting* for a peer (its file keeps changing, its step does
not), and from a rank *behind* the others (it is in another step or phase while they wait).
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

HEARTBEAT_S = 1.0  # how often each rank's thread rewrites its file

# The phases a rank goes through, in order. The supervisor bounds the setup phases by the plan (first start)
# or by the previous attempt's setup time, the loop phases by the run's own step and save times.
IMPORTS, PROCESS_GROUP, MODEL_LOAD = "imports", "process group", "model load"
DATA_LOAD, CHECKPOINT_LOAD = "data", "checkpoint load"
REFERENCE = "reference pass"  # preference training's reference log-probabilities (jobs/preference/reference.py)
STEP, NEXT_BATCH, EVAL, SAVE, FINISH = "training step", "next batch", "eval", "save", "finish"
EXPORT = "export"  # rank 0 writes the HF folder after the final save; the other ranks wait for it
GENERATION = "generation"  # grpo's round of completions and their rewards (jobs/grpo/rounds.py)
EXITED = "exited"  # the worker returned (done) or left after a stop checkpoint: its process may be gone
SETUP_PHASES = (IMPORTS, PROCESS_GROUP, MODEL_LOAD, DATA_LOAD, CHECKPOINT_LOAD, REFERENCE)
LONG_PHASES = (SAVE, EVAL, EXPORT, GENERATION)  # bounded by their own earlier durations, not by the step time
LOOP_PHASES = (NEXT_BATCH, STEP, EVAL, SAVE, FINISH, EXPORT, EXITED, GENERATION)
PHASES = SETUP_PHASES + LOOP_PHASES
FIRST_SETUP_BOUND_S = 900.0  # a first start has no earlier setup to compare with (recovery.setup_timeout_s auto)


def first_setup_bound_s(planned_work_s: float | None) -> float:
    """A first start's setup bound: 3 x the plan's set-up work (planner/timing.setup_work_s: the weights read, the
    data tokenized) + the floor, which holds the imports, the process groups and the model build. A data set
    whose tokenization outlasts the floor is not killed as a hang."""
    return FIRST_SETUP_BOUND_S + 3 * float(planned_work_s or 0.0)


def export_wait_s(setup_timeout_s: int | str, stall_floor_s: int) -> int:
    """How long the other ranks wait on gloo for rank 0's export (jobs/train.py): the export phase's own bound,
    not fsdp.collective_timeout_s. The supervisor bounds a first export like any first long phase, by
    max(setup bound, 4 x recovery.stall_floor_s), and ends a stuck one itself; the wait is twice that, so no
    rank times out an export the supervisor still lets run, and a rank 0 that dies ends the wait at once (gloo
    sees its connection close)."""
    setup = FIRST_SETUP_BOUND_S if setup_timeout_s == "auto" else float(setup_timeout_s)
    return int(2 * max(setup, 4 * stall_floor_s))


def heartbeat_dir(run_dir: Path | str) -> Path:
    return Path(run_dir) / "heartbeat"


@dataclass(frozen=True)
class Beat:
    """One rank's last heartbeat as the supervisor reads it."""

    rank: int
    host: str  # Slurm's node name where there is one
    machine: str  # the kernel's host name: where a process id means something
    pid: int
    launch: int  # the supervisor's launch number in this allocation (0: first); older files are ignored
    step: int
    phase: str
    phase_since: float  # wall time the rank entered ``phase`` (or started ``step``)
    time: float  # wall time of this write: stops advancing when the process is frozen
    # The longest save and eval this rank has finished in this launch, in seconds. The rank measures them
    # itself: a save shorter than the heartbeat interval is never seen in progress by the supervisor.
    longest: dict[str, float] = field(default_factory=dict)
    # What the phase has done so far, where it says (data: the examples tokenized, or whose table it waits for):
    # the heartbeat shows a long set-up moving.
    progress: dict = field(default_factory=dict)

    @classmethod
    def from_json(cls, data: dict) -> Beat:
        # A missing required key raises TypeError (the reader skips the file); ``longest`` may be absent.
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})


def read_beats(run_dir: Path | str, launch: int | None = None) -> list[Beat]:
    """Every rank's newest heartbeat (of ``launch`` only, when given), by rank; unreadable files skipped."""
    beats = []
    for path in sorted(heartbeat_dir(run_dir).glob("rank-*.json")):
        try:
            beat = Beat.from_json(json.loads(path.read_text(encoding="utf-8")))
        except (OSError, ValueError, KeyError, TypeError):
            continue  # a rank writing right now renames atomically, so this is a foreign or old file
        if launch is None or beat.launch == launch:
            beats.append(beat)
    return sorted(beats, key=lambda b: b.rank)


class Heartbeat:
    """The writer side: ``beat.enter(phase)`` and ``beat.at_step(n)`` from the main thread; a daemon thread
    writes. ``enabled=False`` (outside a supervised run) makes both no-ops without a thread."""

    def __init__(self, run_dir: Path | str | None, *, rank: int = 0, launch: int = 0, enabled: bool = True,
                 interval_s: float = HEARTBEAT_S):
        self.enabled, self.rank, self.launch, self.interval_s = enabled, rank, launch, interval_s
        self.step, self.phase, self.phase_since = 0, IMPORTS, time.time()
        self.longest: dict[str, float] = {}
        self.progress: dict = {}
        self._path = heartbeat_dir(run_dir or ".") / f"rank-{rank}.json"
        # Slurm's node name (what --exclude takes; dev-cluster nodes share one machine), and the machine.
        self._host = os.environ.get("SLURMD_NODENAME") or os.uname().nodename
        self._machine, self._stop = os.uname().nodename, threading.Event()
        self._thread: threading.Thread | None = None
        if enabled:
            self._path.parent.mkdir(parents=True, exist_ok=True)
            self._write()
            self._thread = threading.Thread(target=self._loop, name="fsdpjob-heartbeat", daemon=True)
            self._thread.start()

    def enter(self, phase: str) -> None:
        now = time.time()
        if self.phase in LONG_PHASES:
            self._finished_long(now)
        self.phase, self.phase_since, self.progress = phase, now, {}

    def report(self, **progress) -> None:
        """The phase's progress so far (a new dict: the heartbeat thread may be serializing the old one)."""
        self.progress = dict(progress)

    def at_step(self, step: int, phase: str = STEP) -> None:
        """A few stores: this runs on every training step."""
        self.step = step
        self.enter(phase)

    def _finished_long(self, now: float) -> None:
        took = now - self.phase_since
        if took > self.longest.get(self.phase, -1.0):
            # A new dict, not an update: the heartbeat thread may be serializing the old one right now.
            self.longest = {**self.longest, self.phase: took}

    def close(self) -> None:
        self._stop.set()

    def write_now(self) -> None:
        """Write the beat now, not at the thread's next tick (a test hook about to freeze the process: its last
        beat then says exactly where it froze)."""
        if self.enabled:
            self._write()

    def exited(self) -> None:
        """A clean exit, written now (not by the thread): the supervisor must not take it for a crash."""
        self.close()
        if self.enabled:
            self.phase = EXITED
            self._write()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self._write()
            except OSError:
                pass  # a full or vanished disk: the supervisor sees a stale beat, which is what happened

    def _write(self) -> None:
        record = {"rank": self.rank, "host": self._host, "machine": self._machine, "pid": os.getpid(),
                  "launch": self.launch, "step": self.step, "phase": self.phase, "phase_since": self.phase_since,
                  "time": time.time(), "longest": self.longest, "progress": self.progress}
        # Per thread: the main thread's last write (exited) may overlap the heartbeat thread's.
        tmp = self._path.with_name(f".{self._path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        tmp.write_text(json.dumps(record), encoding="utf-8")
        os.replace(tmp, self._path)  # no fsync: a heartbeat lost to a node crash is a stale heartbeat


# The process's one heartbeat: the worker starts it first thing; the loop, the saver and the evaluator mark
# their phases through these functions without passing it around. Off (no thread, no file) until started.
_current = Heartbeat(None, enabled=False)


def start(run_dir: Path | str, *, rank: int, launch: int) -> Heartbeat:
    global _current
    _current.close()
    _current = Heartbeat(run_dir, rank=rank, launch=launch)
    return _current


def current() -> Heartbeat:
    return _current


def enter(phase: str) -> None:
    _current.enter(phase)


def report(**progress) -> None:
    _current.report(**progress)


def at_step(step: int, phase: str = STEP) -> None:
    _current.at_step(step, phase)


def beat_now() -> None:
    _current.write_now()
