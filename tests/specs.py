"""The tests' one job-spec builder: a dict in (a base, sections merged over it), a YAML file or a JobSpec out;
and the bases several test modules share (the quickstart assets, the planner's model folder, Llama-2-70B)."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import yaml


def build(base: dict[str, Any], /, **changes: Any) -> dict[str, Any]:
    """A copy of ``base`` with ``changes``: ``section={...}`` merges into that section, ``section__field=v``
    sets one (nested) field, anything else replaces the top-level key."""
    spec = copy.deepcopy(base)
    for key, value in changes.items():
        if "__" in key:
            *parents, leaf = key.split("__")
            node = spec
            for part in parents:
                node = node.setdefault(part, {})
            node[leaf] = value
        elif isinstance(value, dict) and isinstance(spec.get(key), dict):
            spec[key] = {**spec[key], **value}
        else:
            spec[key] = value
    return spec


def write_spec(path: Path, spec: dict[str, Any] | str | bytes) -> Path:
    """``spec`` as a YAML file at ``path`` (what `fsdpjob validate/submit` read); text or bytes as they are."""
    if isinstance(spec, dict):
        spec = yaml.safe_dump(spec)
    path.write_bytes(spec if isinstance(spec, bytes) else spec.encode("utf-8", "surrogatepass"))
    return path


def quickstart_spec(assets: dict, /, **changes: Any) -> dict[str, Any]:
    """A spec over `make_quickstart`'s tiny Llama and its data (rows of 64 tokens), with ``changes`` (as build)."""
    base = {"model": {"path": assets["model_path"]}, "data": {"path": assets["data_path"], "seq_len": 64}}
    return build(base, **changes)


def write_config(folder: Path, cfg: dict) -> Path:
    """A model folder holding only ``cfg`` as its config.json: what the planner reads."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def plan_spec(model_dir: Path, /, **sections: Any):
    """The planner tests' JobSpec: the model in ``model_dir``, 500 steps, with ``sections`` (as build)."""
    base = {"name": "plan-test", "model": {"path": str(model_dir)}, "data": {"path": "train.jsonl"},
            "train": {"max_steps": 500}}
    return job_spec(build(base, **sections))


# Llama-2-70B's config.json as the submit preflight tests write it (no torch_dtype: the checkpoint reads float32).
LLAMA2_70B_SUBMIT = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 32000, "hidden_size": 8192,
    "intermediate_size": 28672, "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
    "max_position_embeddings": 4096, "tie_word_embeddings": False, "rms_norm_eps": 1e-5,
}  # fmt: skip


def llama2_70b_spec(folder: Path, nodes: int) -> Path:
    """The seed recipe as a spec file in ``folder`` (Llama-2-70B on ``nodes`` x 8 A100-80GB), beside its model
    folder (config.json and empty weight and tokenizer files) and a one-line data file."""
    model = write_config(folder / "llama-2-70b", LLAMA2_70B_SUBMIT)
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        (model / name).write_text("{}")  # the planner reads config.json only
    (folder / "data.jsonl").write_text('{"text": "hello"}\n')
    return write_spec(folder / "seed.yaml", {
        "name": "llama2-70b", "profile": "a100-80gb", "resources": {"nodes": nodes, "time_limit": "12:00:00"},
        "model": {"path": "llama-2-70b", "activation_checkpointing": True},
        "data": {"path": "data.jsonl", "seq_len": 2048}, "train": {"max_steps": 100, "micro_batch_size": 1},
        "fsdp": {"separate_root": False},  # the recipe's root unit, held gathered (auto would separate it)
    })  # fmt: skip


def job_spec(spec: dict[str, Any]):
    """``spec`` validated, as the worker and the planner take it."""
    from fsdpjob.orchestrator.core.jobspec.spec import JobSpec

    return JobSpec.model_validate(spec)
