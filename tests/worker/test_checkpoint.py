"""Checkpoints on real gloo ranks: exact resume, resharding, crash mid-save, damage fallback, purge, export."""

from __future__ import annotations

import io
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from ckpt_driver import FINGERPRINT, SEED, Trainer, manager, rng_snapshot, tiny_config
from distributed import free_port, run_ranks

from fsdpjob.jobs.checkpoint import MARKER, CheckpointError, committed_steps, select_checkpoint, step_dir_name
from fsdpjob.jobs.checkpoint.state import derived_seed
from fsdpjob.jobs.checkpoint.verify import ResumeRefused
from fsdpjob.jobs.export import export_from_path, export_hf

pytestmark = pytest.mark.distributed
DRIVER = Path(__file__).with_name("ckpt_driver.py")


def mismatches(a: Any, b: Any, path: str = "") -> list[str]:
    """Paths where two nested states differ (tensors compared bitwise, dtype and shape included)."""
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return [f"{path}: keys {sorted(map(str, a.keys() ^ b.keys()))}"]
        return [m for k in a for m in mismatches(a[k], b[k], f"{path}/{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{path}: lengths {len(a)} != {len(b)}"]
        return [m for i, (x, y) in enumerate(zip(a, b)) for m in mismatches(x, y, f"{path}/{i}")]
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        same = isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
        return [] if same and a.shape == b.shape and torch.equal(a, b) else [path]
    if hasattr(a, "dtype") and hasattr(a, "shape"):  # numpy arrays in the NumPy RNG state
        return [] if (a == b).all() else [path]
    return [] if a == b else [f"{path}: {a!r} != {b!r}"]


def portable(obj: Any) -> bytes:
    """Tensors sent through run_ranks' queue would use shared memory owned by the exiting child; send bytes."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def unportable(blob: bytes) -> Any:
    return torch.load(io.BytesIO(blob), weights_only=False)


def _init(rank: int, world_size: int) -> None:
    dist.init_process_group("gloo", rank=rank, world_size=world_size)


def _log_lines() -> list[str]:
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("fsdpjob.checkpoint")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    return lines


# ----------------------------------------------------------------------------------------------
# Same world size: exact restore and bitwise continuation (sync and async).


def _snapshot(t: Trainer) -> dict[str, Any]:
    return {
        "full": t.full_state(),
        "rng": rng_snapshot(),
        "sched": t.scheduler.state_dict(),
        "train": dict(t.train),
        "data": t.data.state_dict(),
    }


def _exact_resume(rank: int, world_size: int, root: str, async_save: bool) -> dict[str, Any]:
    _init(rank, world_size)
    t = Trainer(rank, world_size)
    ckpt = manager(Path(root), rank, world_size, async_save=async_save)
    for _ in range(3):
        t.step()
    ckpt.save(3, t.state(), reason="interval")
    saved = _snapshot(t)
    reference = [t.step()]
    in_flight = None
    if async_save:
        # The step above overlapped the background write; save(4) must finish and commit step 3 first.
        ckpt.save(4, t.state(), reason="interval")
        in_flight = {"step3_committed": (Path(root) / step_dir_name(3) / MARKER).is_file(), "pending": ckpt.in_flight}
    reference += [t.step(), t.step()]
    reference_full = t.full_state()
    ckpt.wait()
    if async_save:
        step_dir = ckpt.resume_from(Path(root) / step_dir_name(3), FINGERPRINT)
    else:
        step_dir = ckpt.find_resume(FINGERPRINT)
    sidecar = ckpt.load(step_dir, t.state())
    restored = _snapshot(t)
    continued = [t.step() for _ in range(3)]
    result = {
        "step_dir": step_dir.name,
        "sidecar_step": sidecar["step"],
        "sidecar_counters": (sidecar["train"], sidecar["data"], sidecar["model_key"]),
        "saved_counters": (saved["train"], saved["data"]),
        "restore_mismatches": mismatches(saved, restored),
        "losses": (reference, continued),
        "continue_mismatches": mismatches(reference_full, t.full_state()),
        "in_flight": in_flight,
        "committed": [s for s, _ in committed_steps(Path(root))],
    }
    ckpt.close()
    dist.destroy_process_group()
    return result


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_resume_is_exact_and_continues_bitwise(tmp_path: Path, async_save: bool) -> None:
    results = run_ranks(_exact_resume, 2, root=str(tmp_path), async_save=async_save)
    for r in results:
        assert r["step_dir"] == step_dir_name(3) and r["sidecar_step"] == 3
        assert r["restore_mismatches"] == []
        assert r["sidecar_counters"] == (*r["saved_counters"], "model")  # readable before loading
        reference, continued = r["losses"]
        assert continued == reference  # bitwise: float equality of every loss
        assert r["continue_mismatches"] == []
    if async_save:
        assert results[0]["in_flight"] == {"step3_committed": True, "pending": 4}
        # Resuming from step 3 uncommits the newer step 4: the run now diverges from it.
        assert results[0]["committed"] == [3]
    else:
        assert results[0]["committed"] == [3]


# ----------------------------------------------------------------------------------------------
# Resharding: written by 2 ranks, loaded on 1 and 3.


def _write_two_rank(rank: int, world_size: int, root: str, model_dir: str) -> dict[str, Any]:
    _init(rank, world_size)
    t = Trainer(rank, world_size)
    ckpt = manager(Path(root), rank, world_size, sidecar={"model_path": model_dir})
    for _ in range(2):
        t.step()
    ckpt.save(2, t.state(), reason="final")
    full = t.full_state()
    ckpt.close()
    dist.destroy_process_group()
    return portable({"full": full, "train": dict(t.train), "sched": t.scheduler.state_dict()})


def _load_resharded(rank: int, world_size: int, root: str) -> dict[str, Any]:
    _init(rank, world_size)
    lines = _log_lines()
    t = Trainer(rank, world_size, init_seed=123)  # different init: the load must overwrite everything
    ckpt = manager(Path(root), rank, world_size)
    sidecar = ckpt.load(ckpt.find_resume(FINGERPRINT), t.state())
    rng_after_load = torch.get_rng_state()
    torch.manual_seed(derived_seed(SEED, 2, rank))
    result = {
        "full": t.full_state(),
        "train": dict(t.train),
        "sched": t.scheduler.state_dict(),
        "rng_rederived": torch.equal(rng_after_load, torch.get_rng_state()),
        "log": [line for line in lines if "re-derived" in line],
        "written_by": sidecar["world_size"],
        "loss": t.step(),
    }
    ckpt.close()
    dist.destroy_process_group()
    return portable(result)


@pytest.fixture(scope="module")
def two_rank_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A run folder with a 2-rank FSDP2 checkpoint at step 2, and the model folder it records."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    base = tmp_path_factory.mktemp("two_rank")
    model_dir = base / "model"
    tiny_config().save_pretrained(model_dir)
    vocab = {"<unk>": 0, "hello": 1, "world": 2}
    tokenizer = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer).save_pretrained(model_dir)
    root = base / "run" / "checkpoints"
    written = run_ranks(_write_two_rank, 2, root=str(root), model_dir=str(model_dir))
    return {"run": base / "run", "root": root, "model_dir": model_dir, "written": unportable(written[0])}


@pytest.mark.parametrize("world_size", [1, 3])
def test_reshard_load_is_exact_and_rederives_rng(two_rank_checkpoint: dict[str, Any], world_size: int) -> None:
    written = two_rank_checkpoint["written"]
    results = run_ranks(_load_resharded, world_size, root=str(two_rank_checkpoint["root"]))
    for rank, r in enumerate(map(unportable, results)):
        assert r["written_by"] == 2
        assert mismatches(written["full"], r["full"]) == [], f"rank {rank}"
        assert r["train"] == written["train"] and r["sched"] == written["sched"]
        assert r["rng_rederived"], f"rank {rank}: RNG not re-derived from (seed, step, rank)"
        assert len(r["log"]) == 1 and "written by 2 ranks, this run has" in r["log"][0]


# ----------------------------------------------------------------------------------------------
# A rank SIGKILLed in the middle of a save.


def _spawn_driver(root: Path, world_size: int, fault_env: dict[str, str]) -> list[subprocess.Popen]:
    port = str(free_port())
    procs = []
    for rank in range(world_size):
        env = os.environ | fault_env
        env |= {"RANK": str(rank), "WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
        env |= {"OMP_NUM_THREADS": "1"}
        cmd = [sys.executable, str(DRIVER), str(root)]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    return procs


def _wait_for_line(proc: subprocess.Popen, needle: str, timeout: float) -> list[str]:
    deadline, seen = time.monotonic() + timeout, []
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        seen.append(line)
        if needle in line:
            return seen
    raise AssertionError(f"no {needle!r} within {timeout} s; output:\n{''.join(seen)}")


@pytest.mark.parametrize("victim", [0, 1])
def test_rank_killed_mid_save_leaves_previous_step(tmp_path: Path, victim: int) -> None:
    fault = {"FSDPJOB_FAULT_SAVE_PAUSE_S": "120", "FSDPJOB_FAULT_SAVE_RANK": str(victim)}
    fault["FSDPJOB_FAULT_SAVE_STEP"] = "2"
    procs = _spawn_driver(tmp_path, 2, fault)
    try:
        _wait_for_line(procs[victim], "fault injection: rank", timeout=90)
        procs[victim].send_signal(signal.SIGKILL)
        survivor = procs[1 - victim]
        try:
            survivor.wait(timeout=30)  # gloo notices the closed peer and the save raises
        except subprocess.TimeoutExpired:
            survivor.kill()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    partial = tmp_path / step_dir_name(2)
    assert partial.is_dir() and not (partial / MARKER).exists()
    assert [s for s, _ in committed_steps(tmp_path)] == [1]
    ckpt = manager(tmp_path, 0, 1)  # start-up purge removes the uncommitted leftover
    assert ckpt.find_resume(FINGERPRINT) == tmp_path / step_dir_name(1)
    assert not partial.exists()
    assert (tmp_path / "latest").read_text().strip() == step_dir_name(1)


# ----------------------------------------------------------------------------------------------
# In one process (no process group): damage fallback, purge, fingerprint.


def _save_steps(root: Path, steps: list[int], **kwargs: Any) -> Any:
    t = Trainer(0, 1)
    ckpt = manager(root, 0, 1, **kwargs)
    for step in steps:
        t.step()
        ckpt.save(step, t.state(), reason="interval")
    ckpt.close()
    return t


@pytest.mark.parametrize("damage_kind", ["truncated", "missing"])
def test_damaged_newest_step_falls_back(tmp_path: Path, caplog: pytest.LogCaptureFixture, damage_kind: str) -> None:
    _save_steps(tmp_path, [1, 2])
    shard = tmp_path / step_dir_name(2) / "__0_0.distcp"
    if damage_kind == "truncated":
        with open(shard, "r+b") as fh:
            fh.truncate(shard.stat().st_size // 2)
    else:
        shard.unlink()
    caplog.set_level(logging.WARNING, logger="fsdpjob.checkpoint")
    ckpt = manager(tmp_path, 0, 1)
    assert ckpt.find_resume(FINGERPRINT) == tmp_path / step_dir_name(1)
    assert f"shard __0_0.distcp is {damage_kind}" in caplog.text and "falling back" in caplog.text
    with pytest.raises(CheckpointError, match=f"is {damage_kind}"):
        ckpt.resume_from(tmp_path / step_dir_name(2))
    t = Trainer(0, 1)
    assert ckpt.load(ckpt.find_resume(FINGERPRINT), t.state())["step"] == 1
    # The damaged newer step is uncommitted after the load, so purge can remove it.
    assert [s for s, _ in committed_steps(tmp_path)] == [1] and ckpt.has_committed()
    assert (tmp_path / "latest").read_text().strip() == step_dir_name(1)
    (tmp_path / step_dir_name(1) / ".metadata").write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="every committed checkpoint is damaged.*metadata is unreadable"):
        ckpt.find_resume(FINGERPRINT)  # never a silent fresh start over lost progress


def test_keep_last_and_leftovers(tmp_path: Path) -> None:
    (tmp_path / "step-3").mkdir(parents=True)  # an uncommitted leftover from a crashed run (unpadded name)
    (tmp_path / "step-3" / "__0_0.distcp").write_bytes(b"partial")
    ckpt = manager(tmp_path, 0, 1, keep_last=2)
    assert not (tmp_path / "step-3").exists(), "start-up removes uncommitted leftovers"
    ckpt.close()
    _save_steps(tmp_path, [1, 2, 3, 4, 5], keep_last=2)
    assert [s for s, _ in committed_steps(tmp_path)] == [4, 5]
    assert (tmp_path / "latest").read_text().strip() == step_dir_name(5)
    ckpt = manager(tmp_path, 0, 1, keep_last=1)
    (tmp_path / step_dir_name(2)).mkdir()  # uncommitted and older than the newest committed
    ckpt.purge()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", step_dir_name(5)]


def test_select_checkpoint_from_step_root_or_run(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    _save_steps(elsewhere, [1, 2])
    run = tmp_path / "run"
    run.mkdir()
    (run / "spec.json").write_text(json.dumps({"spec": {"checkpoint": {"dir": str(elsewhere)}}}))
    newest = elsewhere / step_dir_name(2)
    assert select_checkpoint(newest) == newest and select_checkpoint(elsewhere) == newest
    assert select_checkpoint(run) == newest  # checkpoint.dir from the run's spec.json
    with pytest.raises(CheckpointError, match="not a checkpoint"):
        select_checkpoint(tmp_path)


def test_fingerprint_mismatch_refuses(tmp_path: Path) -> None:
    _save_steps(tmp_path, [1])
    ckpt = manager(tmp_path, 0, 1)
    changed = FINGERPRINT | {"data.seq_len": 32, "model.dtype": "bfloat16"}
    with pytest.raises(ResumeRefused) as info:
        ckpt.find_resume(changed)
    message = str(info.value)
    assert "data.seq_len: checkpoint has 16, this spec has 32" in message
    assert "model.dtype: checkpoint has 'float32', this spec has 'bfloat16'" in message
    assert "model.path" not in message and "checkpoint.dir" in message


# ----------------------------------------------------------------------------------------------
# Export to a Hugging Face folder.


def _loaded_weights(out: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(out, dtype=dtype).state_dict()


def test_export_fp32_is_bitwise_and_sharded(two_rank_checkpoint: dict[str, Any], tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    expected = two_rank_checkpoint["written"]["full"]["model"]
    out = tmp_path / "hf"
    source = export_from_path(two_rank_checkpoint["run"], out, "fp32")  # model folder from the sidecar
    assert source == two_rank_checkpoint["root"] / step_dir_name(2)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert sorted(index["weight_map"]) == sorted(expected)
    assert index["metadata"]["total_size"] == sum(t.numel() * 4 for t in expected.values())
    assert files == sorted(p.name for p in out.glob("model-*.safetensors")) == ["model-00001-of-00001.safetensors"]
    assert json.loads((out / "config.json").read_text())["dtype"] == "float32"
    assert mismatches(expected, _loaded_weights(out, torch.float32)) == []
    assert AutoTokenizer.from_pretrained(out)("hello world")["input_ids"] == [1, 2]


def test_export_takes_a_run_id_and_writes_its_newest_committed_checkpoint(two_rank_checkpoint: dict[str, Any],
                                                                          tmp_path: Path) -> None:
    import shutil

    from helpers import fsdpjob

    from fsdpjob.orchestrator import registry
    from fsdpjob.orchestrator.registry import JobRecord

    run = tmp_path / "run"
    shutil.copytree(two_rank_checkpoint["run"], run)
    (run / "checkpoints" / step_dir_name(5)).mkdir()  # a save that never committed: not exported
    registry.save(JobRecord(run_id="exp-20261203-100000-abcd", name="exp", run_dir=str(run), scheduler="local",
                            job_id="999999990", profile="local", submitted_at=1.0, spec_hash="h", nodes=1,
                            tasks_per_node=2, max_steps=2, gpus_per_node=0))
    done = fsdpjob("export", "exp-2026", "--out", str(tmp_path / "hf"), "--dtype", "fp32", cwd=tmp_path,
                   timeout_s=300, check=True)
    assert done.stdout.strip() == f"exported {run / 'checkpoints' / step_dir_name(2)} -> {tmp_path / 'hf'}"
    expected = two_rank_checkpoint["written"]["full"]["model"]
    assert mismatches(expected, _loaded_weights(tmp_path / "hf", torch.float32)) == []


def test_export_bf16_in_small_shards(two_rank_checkpoint: dict[str, Any], tmp_path: Path) -> None:
    expected = two_rank_checkpoint["written"]["full"]["model"]
    step_dir = two_rank_checkpoint["root"] / step_dir_name(2)
    out = export_hf(step_dir, two_rank_checkpoint["model_dir"], tmp_path / "hf", "bf16", max_shard_bytes=16_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shard_count = len(set(index["weight_map"].values()))
    assert shard_count > 1 and (out / f"model-00001-of-{shard_count:05d}.safetensors").is_file()
    bf16 = {k: v.to(torch.bfloat16) for k, v in expected.items()}
    assert mismatches(bf16, _loaded_weights(out, torch.bfloat16)) == []
    with pytest.raises(CheckpointError, match="not empty"):
        export_hf(step_dir, two_rank_checkpoint["model_dir"], out, "bf16")


def test_export_skips_tied_lm_head(tmp_path: Path) -> None:
    t = Trainer(0, 1, tie=True)
    model_dir = tmp_path / "model"
    tiny_config(tie=True).save_pretrained(model_dir)
    ckpt = manager(tmp_path / "ckpt", 0, 1)
    ckpt.save(1, t.state(), reason="final")
    ckpt.close()
    out = export_hf(tmp_path / "ckpt" / step_dir_name(1), model_dir, tmp_path / "hf", "fp32")
    assert "lm_head.weight" not in json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    loaded = _loaded_weights(out, torch.float32)
    assert torch.equal(loaded["lm_head.weight"], t.model.model.embed_tokens.weight.detach())
    assert mismatches({k: v.detach() for k, v in t.model.state_dict().items()}, loaded) == []


def test_a_checkpoint_written_before_a_train_field_was_added_still_loads(tmp_path: Path) -> None:
    import math

    from fsdpjob.jobs.checkpoint.state import DictState
    from fsdpjob.jobs.parts import TrainState

    class Before:  # TrainState as checkpoints from before the "loss" field hold it
        def state_dict(self) -> dict:
            return {"step": 7, "tokens_seen": 70, "global_batch": 4}

    ckpt = manager(tmp_path, 0, 1)
    ckpt.save(7, {"train": DictState(Before())}, reason="stop")
    ckpt.wait()
    state = TrainState()
    ckpt.load(tmp_path / step_dir_name(7), {"train": DictState(state, optional=TrainState.ADDED)})
    assert (state.step, state.tokens_seen, state.global_batch) == (7, 70, 4) and math.isnan(state.loss)
    from torch.distributed.checkpoint.api import CheckpointException

    with pytest.raises(CheckpointException) as info:  # only declared additions may be missing
        ckpt.load(tmp_path / step_dir_name(7), {"train": DictState(TrainState())})
    assert "Missing key in checkpoint state_dict: train.loss" in repr(info.value.failures)
    ckpt.close()


def test_async_save_is_refused_at_set_up_on_a_torch_without_default_stager() -> None:
    from fsdpjob.jobs.checkpoint.staging import check_async_save_torch

    for version in ("2.9.0", "2.13.0+cpu", "3.0.0a0"):
        check_async_save_torch(version)
    with pytest.raises(RuntimeError, match=r"async_save needs torch >= 2\.9 .* has torch 2\.8\.1\+cu128"):
        check_async_save_torch("2.8.1+cu128")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_async_stager_thread_is_on_this_ranks_device_and_copies_on_its_own_stream() -> None:
    from fsdpjob.jobs.checkpoint.staging import stage_in_background

    device = torch.cuda.device_count() - 1  # the last GPU: a thread left on GPU 0 would show
    torch.cuda.set_device(device)
    stager = stage_in_background(True)
    try:
        if stager._staging_executor is None:
            pytest.skip("FSDPJOB_CHECKPOINT_IO=stock stages in save()")
        assert stager._staging_executor.submit(torch.cuda.current_device).result() == device
        assert stager._staging_stream != torch.cuda.current_stream()
        x = torch.arange(1 << 20, device="cuda", dtype=torch.float32)
        x.mul_(2)  # queued on the compute stream: the copy must wait for it
        staged = stager.stage({"x": x}).result()
        assert staged["x"].device.type == "cpu" and torch.equal(staged["x"], x.cpu())
    finally:
        stager.close()
