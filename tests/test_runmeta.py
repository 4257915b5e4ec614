"""The run folder's spec.json (core/runfolder/runmeta.py): one format written, every reader through RunMeta."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from fsdpjob.orchestrator.core.jobspec.spec import JobSpec
from fsdpjob.orchestrator.core.runfolder.paths import RunPaths
from fsdpjob.orchestrator.core.runfolder.runmeta import EffectiveFacts, RunMeta, checkpoint_root, stop_signal

SPEC = {"name": "meta", "model": {"path": "m"}, "data": {"path": "d.jsonl"}, "train": {"max_steps": 3}}


def test_write_then_read_gives_the_same_facts(tmp_path):
    spec = JobSpec.model_validate(SPEC)
    facts = {"effective": EffectiveFacts(nodes=2, time_limit_s=600), "worker_facts": {"defer_grad_sync": True}}
    meta = RunMeta.of(spec, **facts)
    meta.write(RunPaths(tmp_path))
    assert RunMeta.read(tmp_path) == meta
    assert json.loads((tmp_path / "spec.json").read_text())["spec_hash"] == spec.spec_hash()
    assert JobSpec.model_validate(RunMeta.read(tmp_path).spec) == spec


def test_a_spec_json_written_before_the_rename_gives_its_plan_as_worker_facts(tmp_path):
    (tmp_path / "spec.json").write_text(
        json.dumps({"spec": SPEC, "resume_from": None, "plan": {"defer_grad_sync": True}}))
    assert RunMeta.read(tmp_path).worker_facts == {"defer_grad_sync": True}


def test_the_checkpoint_root_is_checkpoint_dir_when_set_else_the_run_folders(tmp_path):
    assert checkpoint_root(tmp_path) == tmp_path / "checkpoints"  # no spec.json at all
    RunMeta(spec={"checkpoint": {"dir": str(tmp_path / "elsewhere")}}).write(RunPaths(tmp_path))
    assert checkpoint_root(tmp_path) == tmp_path / "elsewhere"
    RunMeta(spec={"checkpoint": {"dir": None}}).write(RunPaths(tmp_path))
    assert checkpoint_root(tmp_path) == tmp_path / "checkpoints"


def test_the_stop_signal_is_read_without_pydantic_and_defaults_to_usr2(tmp_path):
    assert stop_signal(tmp_path) == "USR2"
    (tmp_path / "spec.json").write_text("not json")
    assert stop_signal(tmp_path) == "USR2"
    RunMeta(spec={"preemption": {"signal": "TERM"}}).write(RunPaths(tmp_path))
    code = ("import sys; from fsdpjob.orchestrator.core.runfolder.runmeta import stop_signal; "
            "print(stop_signal(sys.argv[1])); "
            "assert 'pydantic' not in sys.modules")
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "TERM"


def test_only_runmeta_and_paths_name_the_file():
    root = Path(__file__).resolve().parents[1]
    files = [p for folder in ("orchestrator", "jobs", "bench") for p in (root / folder).rglob("*.py")]
    naming = sorted(str(p.relative_to(root)) for p in files if '"spec.json"' in p.read_text(encoding="utf-8"))
    assert naming == ["orchestrator/core/runfolder/paths.py"]
