"""The memory tier's pure parts (orchestrator/core/runfolder/memtier.py) on real folders: which step a restart may take
(the newest one whose every shard some surviving node holds), the markers that make a step count, and the tiers
that are never chosen (another job's, a missing or short part, no metadata)."""

from __future__ import annotations

import json
import zlib
from pathlib import Path

from fsdpjob.orchestrator.core.runfolder.ckptlayout import MARKER, SIDECAR, step_dir_name
from fsdpjob.orchestrator.core.runfolder.memtier import (
    METADATA,
    Holding,
    TierKey,
    buddies,
    choose_step,
    drop_corrupt,
    marker_text,
    newest_committed,
    part_name,
    remove_job,
    scan_node,
    shard_name,
)

KEY = TierKey(job="42", restart=0, spec_hash="abc")


def _write_step(folder: Path, step: int, ranks: list[int], *, world: int = 4, key: TierKey = KEY,
                committed: bool = True, metadata: bool = True, parts: dict[int, list[int]] | None = None) -> Path:
    """A node folder's step as the worker leaves it: shard files, parts, metadata and sidecar, marker. ``parts``:
    which rank's part lists which shards (its own, the replicas it received); by default each shard its own rank's."""
    step_dir = folder / step_dir_name(step)
    step_dir.mkdir(parents=True)
    files = {}
    for rank in ranks:
        (step_dir / shard_name(rank)).write_bytes(bytes(100 + rank))
        files[shard_name(rank)] = 100 + rank
    for rank, shards in (parts or {rank: [rank] for rank in ranks}).items():
        record = {"step": step, "job": key.job, "restart": key.restart, "spec_hash": key.spec_hash, "rank": rank,
                  "files": {shard_name(r): files[shard_name(r)] for r in shards},
                  "crc32": {shard_name(r): zlib.crc32(bytes(100 + r)) for r in shards}}
        (step_dir / part_name(rank)).write_text(json.dumps(record))
    if metadata:
        (step_dir / METADATA).write_bytes(b"m")
        (step_dir / SIDECAR).write_text("{}")
    if committed:
        (step_dir / MARKER).write_text(marker_text(step, key, world, ["n1", "n1", "n2", "n2"]))
    return step_dir


def test_newest_step_whose_every_shard_survives_on_some_node(tmp_path):
    n1, n2 = tmp_path / "n1", tmp_path / "n2"
    _write_step(n1, 10, [0, 1, 2, 3])  # own shards 0, 1 and the replicas of n2's 2, 3
    _write_step(n2, 10, [2, 3, 0, 1])
    _write_step(n1, 15, [0, 1])  # step 15: n1 lost the replicas (say it was killed mid-copy)...
    _write_step(n2, 15, [2, 3])
    found = [scan_node(n1, KEY), scan_node(n1, KEY), scan_node(n2, KEY), scan_node(n2, KEY)]
    choice, skipped = choose_step(found)
    # ...yet n2 and n1 together hold every shard of 15: it is chosen, the lowest holder sends each file.
    assert choice is not None and choice.step == 15 and choice.world_size == 4
    assert {name: min(r) for name, r in choice.holders.items()} == {
        shard_name(0): 0, shard_name(1): 0, shard_name(2): 2, shard_name(3): 2}
    assert skipped == []
    # n2 lost: on n1 alone 15 lacks shards 2 and 3, so the older 10 (with n2's replicas) is taken.
    choice, skipped = choose_step([scan_node(n1, KEY), scan_node(n1, KEY)])
    assert choice is not None and choice.step == 10
    assert skipped == [f"step 15: no surviving node holds {shard_name(2)}, {shard_name(3)}"]


def test_stale_damaged_and_uncommitted_tiers_are_never_chosen(tmp_path):
    n1 = tmp_path / "n1"
    _write_step(n1, 5, [0, 1], world=2)
    _write_step(n1, 10, [0, 1], world=2, key=TierKey(job="41", restart=0, spec_hash="abc"))  # an earlier job's
    _write_step(n1, 15, [0, 1], world=2, key=TierKey(job="42", restart=1, spec_hash="abc"))  # after a requeue
    _write_step(n1, 20, [0, 1], world=2, key=TierKey(job="42", restart=0, spec_hash="other"))  # another spec
    _write_step(n1, 25, [0, 1], world=2, committed=False)  # a save cut short
    short = _write_step(n1, 30, [0, 1], world=2)
    (short / shard_name(1)).write_bytes(b"x")  # a part shorter than its record: damaged
    _write_step(n1, 35, [0, 1], world=2)
    (n1 / step_dir_name(35) / shard_name(0)).unlink()  # a missing part
    _write_step(n1, 40, [0, 1], world=2, metadata=False)
    assert [h.step for h in scan_node(n1, KEY)] == [5, 30, 35, 40]
    choice, skipped = choose_step([scan_node(n1, KEY)] * 2)
    assert choice is not None and choice.step == 5
    assert [s.split(":")[0] for s in skipped] == ["step 40", "step 35", "step 30"]
    assert "no node holds its .metadata" in skipped[0] and shard_name(1) in skipped[2]


def test_world_size_disagreement_and_nothing_at_all():
    assert choose_step([[], []]) == (None, [])
    mixed = [[Holding(5, 2, {shard_name(0): 1, shard_name(1): 1}, True)], [Holding(5, 4, {}, True)]]
    choice, skipped = choose_step(mixed)
    assert choice is None and "disagree" in skipped[0]


def test_buddies_are_on_another_node():
    assert buddies(["n1", "n1", "n2", "n2"]) == [2, 3, 0, 1]
    assert buddies(["a", "a", "b", "b", "c", "c"]) == [2, 3, 4, 5, 0, 1]
    assert buddies(["n1", "n1"]) == [None, None]  # one node: no other node to keep a replica
    hosts = ["a", "b", "c", "d"]
    assert all(hosts[b] != hosts[r] for r, b in enumerate(buddies(hosts)))


def test_remove_job_takes_every_node_folder(tmp_path):
    _write_step(tmp_path / "42" / "n1", 5, [0])
    _write_step(tmp_path / "42" / "n2", 5, [1])
    _write_step(tmp_path / "43" / "n1", 5, [0])
    remove_job(tmp_path, "42")
    assert [p.name for p in tmp_path.iterdir()] == ["43"]


def test_the_supervisor_counts_the_newest_committed_snapshot_as_progress(tmp_path):
    assert newest_committed(tmp_path, "42") is None
    _write_step(tmp_path / "42" / "n1", 10, [0])
    _write_step(tmp_path / "42" / "n2", 15, [1])
    _write_step(tmp_path / "42" / "n2", 20, [1], committed=False)
    _write_step(tmp_path / "43" / "n1", 25, [0])
    assert newest_committed(tmp_path, "42") == 15


def test_auto_interval_is_young_daly_in_steps_never_above_the_stall_bound():
    from fsdpjob.orchestrator.core.runfolder.memtier import MAX_STALL_SHARE, auto_interval, mtbi_s

    # 0.2 s stall, 1 s steps, a fault every 10 h: Young/Daly sqrt(2 x 0.2 x 36000) = 120 s -> 120 steps.
    assert auto_interval(0.2, 1.0, 36000.0).steps == 120
    # A fault every 20 s: the optimum (2.8 s) would stall more than 5 %: the bound, 0.2 / 0.05 = 4 s -> 4 steps.
    assert auto_interval(0.2, 1.0, 20.0).steps == round(0.2 / MAX_STALL_SHARE)
    # No rate in the profile: the bound alone; a free snapshot: every step.
    assert auto_interval(0.2, 1.0, None).steps == 4 and auto_interval(0.0, 1.0, None).steps == 1
    assert "no expected_interruptions_per_day" in auto_interval(0.2, 1.0, None).text()
    assert mtbi_s(0.5, 4) == 43200.0 and mtbi_s(None, 4) is None


def test_spec_takes_auto_or_a_count_for_the_memory_interval():
    import pytest
    from pydantic import ValidationError

    from fsdpjob.orchestrator.core.jobspec.spec import CheckpointSpec

    assert CheckpointSpec(memory_interval_steps="auto").memory_interval_steps == "auto"
    assert CheckpointSpec(memory_interval_steps=7).memory_interval_steps == 7
    for bad in ("often", -1, 2.5):
        with pytest.raises(ValidationError):
            CheckpointSpec(memory_interval_steps=bad)


def test_a_file_that_fails_its_checksum_is_dropped_on_its_node_and_a_step_without_a_good_copy_is_skipped(tmp_path):
    """Each rank checks the files its own part lists (verify_rank); a corrupt one is dropped for every rank of that
    node. Shard 1 corrupted on n1 only: n2's replica still makes step 10 whole. Corrupted on both: step 10 is
    skipped (no good copy left) and the older step 5 is taken."""
    n1, n2 = tmp_path / "n1", tmp_path / "n2"
    hosts = ["n1", "n1", "n2", "n2"]
    for step in (5, 10):  # each rank's part: its own shard and the replica it keeps (its buddy's)
        _write_step(n1, step, [0, 1, 2, 3], parts={0: [0, 2], 1: [1, 3]})
        _write_step(n2, step, [2, 3, 0, 1], parts={2: [2, 0], 3: [3, 1]})

    def flip(path: Path) -> None:
        data = bytearray(path.read_bytes())
        data[7] ^= 1
        path.write_bytes(bytes(data))

    def scan() -> list[list[Holding]]:
        return [scan_node(tmp_path / host, KEY, verify_rank=rank) for rank, host in enumerate(hosts)]

    flip(n1 / step_dir_name(10) / shard_name(1))
    found, corrupt = drop_corrupt(scan(), hosts)
    assert corrupt == [f"step 10: {shard_name(1)} on n1 fails its checksum (crc32 "
                       f"{zlib.crc32(bytes(7) + bytes([1]) + bytes(93)):08x}, {zlib.crc32(bytes(101)):08x} written)"]
    assert all(shard_name(1) not in h.files for rank in (0, 1) for h in found[rank] if h.step == 10)
    choice, _ = choose_step(found)
    assert choice is not None and choice.step == 10 and choice.holders[shard_name(1)] == [2, 3]
    flip(n2 / step_dir_name(10) / shard_name(1))
    found, corrupt = drop_corrupt(scan(), hosts)
    assert len(corrupt) == 2
    choice, skipped = choose_step(found)
    assert choice is not None and choice.step == 5 and skipped == [f"step 10: no surviving node holds {shard_name(1)}"]
