"""When the memory tier snapshots with ``memory_interval_steps: auto`` (jobs/checkpoint/memory/schedule.py), driven by a
recorded timeline instead of a run: which steps snapshot, and which snapshot's cost decides the interval."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from fsdpjob.jobs.checkpoint.memory.schedule import MemorySchedule, auto_steps
from fsdpjob.jobs.checkpoint.memory.write import SnapshotWriter
from fsdpjob.orchestrator.core.runfolder.memtier import PROBE_STEPS, auto_interval

STEP_S = 1.0  # every training step
FIRST_STALL_S = 12.0  # the launch's first snapshot: the staging buffers allocated, pinned and faulted in
STALL_S = 0.3  # every later snapshot: a copy into the buffers the first left


def drive(interval_steps: int | str, first: int, last: int) -> tuple[MemorySchedule, list[int]]:
    """Steps first..last as the saver calls the tier: due() after each step, save() when due; a snapshot stalls the
    loop (its save and the next step's wait for the copy), the first one the longest. The schedule, and the steps
    that snapshot."""
    now, waited, saved = [0.0], 0.0, []
    schedule = MemorySchedule(interval_steps, mtbi_s=3600.0, rank=1, slowest=lambda figures: figures,
                              clock=lambda: now[0])
    for step in range(first, last + 1):
        now[0] += STEP_S
        if schedule.due(step, max_steps=1000, waited_s=waited):
            schedule.saved(step)
            stall = FIRST_STALL_S if not saved else STALL_S
            saved.append(step)
            now[0] += stall
            waited += stall
    return schedule, saved


def test_auto_decides_from_the_second_snapshot_not_the_first_which_pays_the_staging_allocation():
    """Issue 36 item 11 (R4): the first snapshot of a launch allocates and pins the staging buffers once; measured,
    it would set the interval by 12 s where every later snapshot stalls 0.3 s."""
    first = 1
    schedule, saved = drive("auto", first, 40)
    choice = schedule.take_auto_choice()
    warm_up, probe, decide = auto_steps(first)
    assert (warm_up, probe, decide) == (first + PROBE_STEPS, first + 2 * PROBE_STEPS, first + 3 * PROBE_STEPS)
    assert choice is not None and choice.stall_s == pytest.approx(STALL_S) and choice.step_s == pytest.approx(STEP_S)
    assert choice.steps == auto_interval(STALL_S, STEP_S, 3600.0).steps  # sqrt(2 x 0.3 x 3600) = 46 s: 46 steps
    assert saved[:2] == [warm_up, probe] and schedule.interval_steps == choice.steps == 46
    assert saved[2:] == []  # the next one is 46 steps after the probe
    assert schedule.take_auto_choice() is None  # told once


def test_a_fixed_interval_is_unchanged_and_the_copy_in_flight_counts_as_waited():
    schedule, saved = drive(4, 1, 13)
    assert saved == [4, 8, 12] and schedule.take_auto_choice() is None
    # The optimizer's wait for the copy in flight is part of the loop's stall before wait() folds it in.
    writer = SimpleNamespace(waited_s=1.0, _gate=SimpleNamespace(waited_s=0.25))
    assert SnapshotWriter.stalled_s.fget(writer) == 1.25
    assert SnapshotWriter.stalled_s.fget(SimpleNamespace(waited_s=1.0, _gate=None)) == 1.0
