"""The disk fills during a durable save (issue 55): the checkpoint folder on a real small file system (a tmpfs
mounted with room for one step and a half; we are root, as CI is). The second save fails with ENOSPC on every rank:
the half-written step is removed and never taken for a checkpoint, every rank raises DiskFull naming ENOSPC, the
folder and the free bytes (not retryable: a restart would fill the disk again), and the run resumed from the last
good step goes on bitwise as a run that never filled its disk. Real gloo ranks, real FSDP2 and DCP."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
from ckpt_driver import FINGERPRINT, Trainer, manager
from distributed import run_ranks

from fsdpjob.jobs.checkpoint import committed_steps, step_dir_name
from fsdpjob.jobs.checkpoint.diskfull import DiskFull

pytestmark = pytest.mark.distributed


def _train(rank: int, world_size: int, root: str, async_save: bool) -> dict[str, Any]:
    """Save step 1, then step 2 (which may not fit); then resume from the newest committed step and train 2 more."""
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    t = Trainer(rank, world_size)
    ckpt = manager(Path(root), rank, world_size, async_save=async_save)
    t.step()
    ckpt.save(1, t.state(), reason="interval")
    t.step()
    failure = None
    try:
        ckpt.save(2, t.state(), reason="interval")
        ckpt.wait()
    except DiskFull as exc:
        failure = str(exc)
    left = {"committed": [s for s, _ in committed_steps(Path(root))],
            "step_2_left": (Path(root) / step_dir_name(2)).exists()}
    ckpt.close()
    resumed = Trainer(rank, world_size, init_seed=5)
    ckpt = manager(Path(root), rank, world_size)
    step_dir = ckpt.find_resume(FINGERPRINT)
    ckpt.load(step_dir, resumed.state())
    losses = [resumed.step(), resumed.step()]
    ckpt.close()
    dist.destroy_process_group()
    return {"failure": failure, **left, "resumed_from": step_dir.name, "losses": losses}


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_full_disk_during_a_save_stops_cleanly_and_the_last_good_step_resumes_bitwise(tmp_path: Path,
                                                                                        async_save: bool) -> None:
    roomy = tmp_path / "roomy"
    reference = run_ranks(_train, 2, root=str(roomy), async_save=async_save)
    assert reference[0]["failure"] is None and reference[0]["committed"] == [1, 2]
    step_bytes = sum(f.stat().st_size for f in (roomy / step_dir_name(1)).iterdir())
    small = tmp_path / "small"
    small.mkdir()
    size_kib = (step_bytes * 3 // 2) // 1024 + 4  # one step and a half: the second save cannot fit
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_kib}k", "tmpfs", str(small)], check=True)
    try:
        faulted = run_ranks(_train, 2, root=str(small), async_save=async_save)
    finally:
        subprocess.run(["umount", str(small)], check=True)
    for got in faulted:
        failure = got["failure"]
        assert failure is not None, "the save on a full disk must fail, on every rank"
        assert "ENOSPC" in failure and str(small) in failure and " bytes free there" in failure, failure
        assert "step 1, is intact" in failure, failure
        assert got["committed"] == [1] and not got["step_2_left"], got  # never a half step left behind
        assert got["resumed_from"] == step_dir_name(1)
    # Resumed from step 1, steps 2 and 3 are those of the run that never filled its disk, from step 1 as well.
    resumed_reference = run_ranks(_resume_at_one, 2, root=str(roomy))
    assert [g["losses"] for g in faulted] == [r["losses"] for r in resumed_reference]


def _resume_at_one(rank: int, world_size: int, root: str) -> dict[str, Any]:
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    t = Trainer(rank, world_size, init_seed=5)
    ckpt = manager(Path(root), rank, world_size)
    ckpt.load(Path(root) / step_dir_name(1), t.state())
    losses = [t.step(), t.step()]
    ckpt.close()
    dist.destroy_process_group()
    return {"losses": losses}


def test_a_full_disk_is_not_retryable() -> None:
    from fsdpjob.jobs.train import _retryable

    assert not _retryable(DiskFull("checkpoint step 2 could not be written: ... (ENOSPC ...)"), "sft")


def test_torchs_short_write_on_a_full_file_system_is_a_full_disk(tmp_path: Path) -> None:
    """torch.save's zip writer (DCP's non-tensor items) reports ENOSPC as a short write without the errno (seen on
    the dev cluster's full tmpfs): it is a full disk where the checkpoint folder's file system is full, and not
    where there is room (a short write for another reason stays the error it is)."""
    from fsdpjob.jobs.checkpoint.diskfull import is_disk_full

    short = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    small = tmp_path / "small"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(small)], check=True)
    try:
        assert not is_disk_full(short, small) and not is_disk_full(short)
        with pytest.raises(OSError):
            (small / "fill").write_bytes(b"\0" * (512 << 10))  # fills it: ENOSPC
        assert is_disk_full(short, small)
        assert not is_disk_full(RuntimeError("unexpected pos somewhere else"), small)
    finally:
        subprocess.run(["umount", str(small)], check=True)
