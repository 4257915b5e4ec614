"""A durable checkpoint whose bytes changed on disk after its commit (a flipped byte, a cut file) is never loaded:
its checksums, taken while it was written, fail; the resume takes the previous step and ends bitwise equal to a
run resumed from that step. Real gloo ranks, real FSDP2 and DCP, real files."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
from ckpt_driver import FINGERPRINT, Trainer, manager
from distributed import run_ranks
from test_checkpoint import mismatches, portable, unportable

from fsdpjob.jobs.checkpoint import MARKER, CheckpointError, committed_steps, select_checkpoint, step_dir_name

pytestmark = pytest.mark.distributed
STEPS = 3  # saved 1..3; step 3 is the one corrupted


def _write(rank: int, world_size: int, root: str) -> None:
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    t = Trainer(rank, world_size)
    ckpt = manager(Path(root), rank, world_size)
    for step in range(1, STEPS + 1):
        t.step()
        ckpt.save(step, t.state(), reason="interval")
    ckpt.close()
    dist.destroy_process_group()


def _resume(root: Path, rank: int, world_size: int) -> dict[str, Any]:
    t = Trainer(rank, world_size, init_seed=99)  # another init: the load must overwrite everything
    ckpt = manager(root, rank, world_size)
    step_dir = ckpt.find_resume(FINGERPRINT)
    ckpt.load(step_dir, t.state())
    losses = [t.step() for _ in range(3)]
    result = {"step_dir": step_dir.name, "passed_over": list(ckpt.passed_over), "losses": losses,
              "full": t.full_state(), "committed": [s for s, _ in committed_steps(root)]}
    ckpt.close()
    return result


def _resume_both(rank: int, world_size: int, corrupted: str, reference: str) -> bytes:
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("fsdpjob.checkpoint").addHandler(handler)
    out = {"corrupted": _resume(Path(corrupted), rank, world_size),
           "reference": _resume(Path(reference), rank, world_size), "log": lines}
    dist.destroy_process_group()
    return portable(out)


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("corrupt") / "written"
    run_ranks(_write, 2, root=str(root))
    return root


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01  # inside a tensor's raw bytes: torch.load would read it without a word
    path.write_bytes(bytes(data))


def _cut(path: Path) -> None:
    with open(path, "r+b") as fh:
        fh.truncate(path.stat().st_size - 1)


def test_every_file_of_a_commit_is_summed_in_its_commit_record(written: Path) -> None:
    step_dir = written / step_dir_name(STEPS)
    record = json.loads((step_dir / MARKER).read_text())
    files = record["checksums"]["files"]
    assert record["checksums"]["algorithm"] == "crc32"
    assert sorted(files) == [".metadata", "__0_0.distcp", "__1_0.distcp", "fsdpjob.json"]
    for name, (size, _) in files.items():
        assert (step_dir / name).stat().st_size == size
    assert not list(step_dir.glob("checksums-*.json")), "the ranks' records are folded into the commit record"


@pytest.mark.parametrize("fault", ["flipped_byte", "cut_file"])
def test_corrupted_newest_step_is_never_loaded_and_the_run_ends_as_from_the_previous(
        written: Path, tmp_path: Path, fault: str) -> None:
    corrupted, reference = tmp_path / "corrupted", tmp_path / "reference"
    shutil.copytree(written, corrupted)
    shutil.copytree(written, reference)
    shutil.rmtree(reference / step_dir_name(STEPS))  # the run as if step 3 had never been saved
    shard = corrupted / step_dir_name(STEPS) / "__1_0.distcp"  # rank 1's: rank 0 alone would not read it
    (_flip_byte if fault == "flipped_byte" else _cut)(shard)

    results = [unportable(r) for r in run_ranks(_resume_both, 2, corrupted=str(corrupted), reference=str(reference))]
    for r in results:
        got, want = r["corrupted"], r["reference"]
        assert got["step_dir"] == want["step_dir"] == step_dir_name(STEPS - 1)
        assert got["losses"] == want["losses"]  # bitwise: float equality
        assert mismatches(got["full"], want["full"]) == []
        assert got["committed"] == [1, 2], "the corrupted step is uncommitted once the run goes on without it"
    why = "fails its checksum" if fault == "flipped_byte" else "truncated"
    passed = results[0]["corrupted"]["passed_over"]
    assert len(passed) == 1 and passed[0].startswith(step_dir_name(STEPS)) and why in passed[0], passed
    assert any("__1_0.distcp" in line and why in line and "falling back" in line for line in results[0]["log"])


def test_an_explicit_corrupted_step_is_refused_and_export_takes_the_previous(written: Path, tmp_path: Path) -> None:
    root = tmp_path / "root"
    shutil.copytree(written, root)
    _flip_byte(root / step_dir_name(STEPS) / "__0_0.distcp")
    with pytest.raises(CheckpointError, match="__0_0.distcp fails its checksum"):
        select_checkpoint(root / step_dir_name(STEPS))
    assert select_checkpoint(root) == root / step_dir_name(STEPS - 1)
