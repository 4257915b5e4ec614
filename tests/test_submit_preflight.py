"""`fsdpjob submit` runs the planner first: a job that cannot fit is refused (exit 2, plan printed, nothing
written) unless --force; --dry-run prints the plan and the script and touches nothing."""

from __future__ import annotations

import json
import os
from pathlib import Path

from helpers import fsdpjob
from specs import write_spec

LLAMA2_70B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 32000, "hidden_size": 8192,
    "intermediate_size": 28672, "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
    "max_position_embeddings": 4096, "tie_word_embeddings": False, "rms_norm_eps": 1e-5,
}


def make_70b_spec(tmp_path: Path, nodes: int) -> Path:
    model = tmp_path / "llama-2-70b"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(LLAMA2_70B))
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        (model / name).write_text("{}")  # the planner reads config.json only
    (tmp_path / "data.jsonl").write_text('{"text": "hello"}\n')
    return write_spec(tmp_path / "seed.yaml", {
        "name": "llama2-70b", "profile": "a100-80gb", "resources": {"nodes": nodes, "time_limit": "12:00:00"},
        "model": {"path": "llama-2-70b", "activation_checkpointing": True},
        "data": {"path": "data.jsonl", "seq_len": 2048}, "train": {"max_steps": 100, "micro_batch_size": 1},
    })  # fmt: skip


def test_submit_refuses_a_job_that_cannot_fit(tmp_path):
    spec = make_70b_spec(tmp_path, nodes=1)
    proc = fsdpjob("submit", str(spec), cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "DOES NOT FIT" in proc.stderr and "fsdp.cpu_offload=true" in proc.stderr and "resources.nodes=3" in proc.stderr
    home = Path(os.environ["FSDPJOB_HOME"])
    assert not (home / "registry").exists() and not (home / "runs").exists()


def test_plan_for_the_seed_case_fits_on_three_nodes(tmp_path):
    proc = fsdpjob("plan", str(make_70b_spec(tmp_path, nodes=3)), "--json", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["fits"] is True


def test_dry_run_prints_plan_and_script_and_touches_nothing(tmp_path):
    proc = fsdpjob("submit", str(make_70b_spec(tmp_path, nodes=3)), "--dry-run", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("#!/bin/bash") and "#SBATCH --nodes=3" in proc.stdout
    assert "FITS" in proc.stderr
    home = Path(os.environ["FSDPJOB_HOME"])
    assert not (home / "registry").exists() and not (home / "runs").exists()
