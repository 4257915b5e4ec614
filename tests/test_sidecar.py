"""A checkpoint's fsdpjob.json (core/runfolder/sidecar.py): one layout written, every reader through Sidecar.read, and
the
sidecars written before the type still read the same."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from fsdpjob.orchestrator.core.runfolder.ckptlayout import SIDECAR
from fsdpjob.orchestrator.core.runfolder.sidecar import (
    BASE_CONTENTS_FINGERPRINT,
    FIELD_KEYS,
    FORMAT_VERSION,
    LORA_FINGERPRINT,
    RunFacts,
    Sidecar,
)

# A LoRA run's step-3 sidecar as CheckpointManager._commit wrote it before the type (train's run facts, the
# manager's facts with world_size and fsdpjob_version from both, the save's facts, the train and data entries).
LEGACY = """{
  "data": {"num_sequences": 40, "packing": "none", "samples_consumed": 12, "seed": 0},
  "eval_loss": 2.25,
  "fingerprint": {
    "data.seq_len": 64,
    "model.dtype": "bf16",
    "model.lora": {"alpha": 32.0, "dropout": 0.0, "modules_to_save": [], "r": 4, "target_modules": "all-linear"},
    "model.path": "/models/tiny",
    "model.path contents": "sha256:0123456789abcdef0123456789abcdef"
  },
  "format": 1,
  "fsdpjob_version": "0.1.0",
  "mesh_shape": [2],
  "model_key": "model",
  "model_path": "/models/tiny",
  "reason": "interval",
  "save_seconds": 0.412,
  "spec_hash": "5d41402abc4b2a76",
  "step": 3,
  "torch_version": "2.9.0+cpu",
  "train": {"global_batch": 4, "loss": 2.5, "step": 3, "tokens_seen": 768},
  "wall_time": 1764700000.25,
  "world_size": 2
}
"""


def _legacy_dir(tmp_path: Path, text: str = LEGACY) -> Path:
    (tmp_path / SIDECAR).write_text(text)
    return tmp_path


def test_a_sidecar_written_before_the_type_reads_into_its_fields(tmp_path):
    side = Sidecar.read(_legacy_dir(tmp_path))
    assert (side.step, side.world_size, side.format, side.fsdpjob_version) == (3, 2, 1, "0.1.0")
    assert (side.reason, side.model_key, side.eval_loss, side.save_seconds) == ("interval", "model", 2.25, 0.412)
    assert side.run.spec_hash == "5d41402abc4b2a76" and side.run.mesh_shape == (2,)
    assert side.run.model_path == "/models/tiny" and side.run.fingerprint["model.dtype"] == "bf16"
    assert side.run.lora["r"] == 4 and side.run.base_contents.startswith("sha256:")
    assert side.state == {"train": {"global_batch": 4, "loss": 2.5, "step": 3, "tokens_seen": 768},
                          "data": {"num_sequences": 40, "packing": "none", "samples_consumed": 12, "seed": 0}}


def test_writing_it_again_gives_the_same_file(tmp_path):
    # Same keys and values, and byte for byte the manager's formatting (indent 2, sorted keys, a final newline).
    side = Sidecar.read(_legacy_dir(tmp_path))
    out = tmp_path / "again"
    out.mkdir()
    side.write(out)
    written = (out / SIDECAR).read_text()
    assert json.loads(written) == json.loads(LEGACY)
    assert written == json.dumps(json.loads(LEGACY), indent=2, sort_keys=True) + "\n"
    assert Sidecar.read(out) == side


def test_a_save_without_run_facts_or_eval_loss_writes_none_of_them(tmp_path):
    # Benches and tests run a manager without a spec: no run facts; a save off an evaluation step has no eval_loss.
    # model_key stays, null, as the manager always wrote it.
    Sidecar(step=1, world_size=1, fsdpjob_version="v", torch_version="t", wall_time=1.0, save_seconds=0.0,
            reason="final").write(tmp_path)
    doc = json.loads((tmp_path / SIDECAR).read_text())
    assert set(doc) == {"format", "fsdpjob_version", "torch_version", "world_size", "step", "wall_time",
                        "save_seconds", "reason", "model_key"}
    assert doc["model_key"] is None and doc["format"] == FORMAT_VERSION


def test_a_minimal_sidecar_reads_with_defaults(tmp_path):
    # What tests/worker/test_eval.py's keep_best fixture writes: a step and maybe an eval loss, nothing else.
    side = Sidecar.read(_legacy_dir(tmp_path, json.dumps({"step": 4, "eval_loss": 1})))
    assert side.step == 4 and side.eval_loss == 1.0 and isinstance(side.eval_loss, float)
    assert side.world_size is None and side.run == RunFacts() and side.state == {} and side.run.lora is None
    # Or not even a step: what export's tests write; readers before the type required no key.
    assert Sidecar.read(_legacy_dir(tmp_path, '{"fingerprint": {"model.path": "/m"}}')).run.lora is None


def test_unknown_keys_objects_are_state_and_scalars_are_skipped(tmp_path):
    doc = {"step": 2, "scheduler": {"last_epoch": 2}, "global_batch_size": 2}
    side = Sidecar.read(_legacy_dir(tmp_path, json.dumps(doc)))
    assert side.state == {"scheduler": {"last_epoch": 2}}


@pytest.mark.parametrize("text", ["[1, 2]", '{"step": "3"}', '{"step": true}', '{"step": 3, "world_size": 2.5}',
                                  '{"step": 3, "fingerprint": [1]}', "{not json", ""])
def test_what_is_no_sidecar_is_a_value_error(tmp_path, text):
    # checkpoint/verify.damage reports a ValueError as an unreadable sidecar, so the step is skipped on resume.
    with pytest.raises(ValueError):
        Sidecar.read(_legacy_dir(tmp_path, text))


def test_a_missing_sidecar_is_an_os_error(tmp_path):
    with pytest.raises(OSError):
        Sidecar.read(tmp_path)


def test_state_entries_cannot_overwrite_fields():
    with pytest.raises(ValueError, match="step"):
        Sidecar(step=1, state={"step": {"x": 1}})
    assert {"step", "world_size", "fsdpjob_version", "fingerprint", "eval_loss", "model_key"} <= FIELD_KEYS
    assert not {"run", "state", "train", "data"} & FIELD_KEYS


def test_run_facts_from_a_dict_reject_what_is_no_run_fact():
    # world_size and fsdpjob_version: callers passed them before the manager wrote them once itself.
    facts = RunFacts.of({"spec_hash": "h", "mesh_shape": [2, 1], "world_size": 2, "fsdpjob_version": "v"})
    assert facts == RunFacts(spec_hash="h", mesh_shape=(2, 1))
    assert RunFacts.of({}) == RunFacts() and RunFacts().to_json() == {}
    with pytest.raises(TypeError, match="global_batch_size"):
        RunFacts.of({"global_batch_size": 2})


def test_lora_keys_are_the_fingerprint_keys_the_spec_produces():
    from fsdpjob.orchestrator.core.jobspec.spec import JobSpec

    spec = JobSpec.model_validate({"name": "s", "model": {"path": "m", "lora": {"r": 4}}, "data": {"path": "d.jsonl"},
                                   "train": {"max_steps": 3}})
    facts = RunFacts(fingerprint={**spec.model_fingerprint(), BASE_CONTENTS_FINGERPRINT: "sha256:x"})
    assert LORA_FINGERPRINT in spec.model_fingerprint() and facts.lora["r"] == 4 and facts.base_contents == "sha256:x"


def test_dict_style_access_reads_the_file_layout(tmp_path):
    # For callers from before the type (bench/crash_consistency.py reads CheckpointManager.load(...)["step"]).
    side = Sidecar.read(_legacy_dir(tmp_path))
    assert side["step"] == 3 and side["train"]["tokens_seen"] == 768 and side["mesh_shape"] == [2]
    assert dataclasses.replace(side, eval_loss=None).to_json().keys() == json.loads(LEGACY).keys() - {"eval_loss"}


class _Counters:
    """A flat-scalar state entry, like train's counters (DictState adapts it to DCP)."""

    def __init__(self, step: int) -> None:
        self.values = {"step": step, "tokens_seen": 64 * step, "loss": float("nan")}

    def state_dict(self) -> dict:
        return dict(self.values)

    def load_state_dict(self, state: dict) -> None:
        self.values = dict(state)


def test_the_manager_writes_the_layout_it_always_wrote_and_keep_best_reads_it(tmp_path):
    # One process, no process group: the manager's commit, load and purge through Sidecar.
    import torch

    from fsdpjob.jobs.checkpoint import CheckpointManager, DictState, ModelOptimState

    model = torch.nn.Linear(4, 4)
    facts = RunFacts(spec_hash="h", fingerprint={"model.path": "/m"}, mesh_shape=(1,), model_path="/m")
    ckpt = CheckpointManager(tmp_path, rank=0, world_size=1, keep_last=1, async_save=False, sidecar=facts,
                             keep_best=True)
    optimizer = torch.optim.AdamW(model.parameters())
    for step, loss in ((1, 0.5), (2, 0.9), (3, None)):
        state = {"model": ModelOptimState(model, optimizer), "train": DictState(_Counters(step))}
        ckpt.save(step, state, reason="interval", eval_loss=loss)
    doc = json.loads((tmp_path / "step-00000001" / SIDECAR).read_text())
    assert set(doc) == set(json.loads(LEGACY)) - {"data"}  # the LoRA run's keys, less its data entry
    assert doc["train"] == {"step": 1, "tokens_seen": 64}  # NaN left out for strict JSON readers
    assert (doc["world_size"], doc["mesh_shape"], doc["model_key"], doc["eval_loss"]) == (1, [1], "model", 0.5)
    assert "eval_loss" not in json.loads((tmp_path / "step-00000003" / SIDECAR).read_text())
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-00000001", "step-00000003"]  # best + newest
    assert ckpt.sidecar == facts.to_json()  # train.resume reads the fingerprint here
    side = ckpt.load(tmp_path / "step-00000003", {"train": DictState(_Counters(0))})
    assert side.step == 3 and side.run == facts and side.state["train"]["step"] == 3 and side["step"] == 3
    ckpt.close()
