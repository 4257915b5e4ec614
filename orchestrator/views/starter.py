"""The starter spec `fsdpjob init` writes: a commented YAML from templates/starter.yaml.j2, filled in from the
profile and, when given, the model folder's config.json (pure: the CLI writes the file)."""

from __future__ import annotations

import json
import re
import shlex
from importlib import resources
from pathlib import Path

import jinja2

from fsdpjob.orchestrator.core.errors import InputError
from fsdpjob.orchestrator.core.inputs.checks import architecture_problem
from fsdpjob.orchestrator.core.jobspec.profiles import ClusterProfile

PLACEHOLDER_MODEL = "/path/to/hf-model-folder"
DEFAULT_SEQ_LEN = 512
GRPO_NEW_TOKENS = 128  # a starter's grpo.max_new_tokens where seq_len leaves room for it
GRPO_FILES = {"rewards.py": "starter_rewards.py.j2", "data.jsonl": "starter_prompts.jsonl.j2"}  # beside the spec


def grpo_file(name: str) -> str:
    """The text of a GRPO starter's file ``name`` (GRPO_FILES: plain text, nothing to fill in)."""
    return resources.files("fsdpjob.templates").joinpath(GRPO_FILES[name]).read_text(encoding="utf-8")


def job_name(out: Path) -> str:
    """A valid run name from the output file's name (letters, digits, '.', '_', '-')."""
    return re.sub(r"[^A-Za-z0-9._-]+", "-", out.stem).lstrip("._-")[:64] or "job"


def _seq_len(model_dir: Path | None) -> int:
    """The default, or less where the model's positions end sooner (validate refuses a longer seq_len). A model
    validate would refuse is refused here, with its words: a starter for it could never run."""
    if model_dir is None:
        return DEFAULT_SEQ_LEN
    try:
        config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        raise InputError(f"no readable config.json in {model_dir}; give a Hugging Face model folder",
                         file="MODEL_DIR") from None
    if not isinstance(config, dict):
        raise InputError(f"config.json in {model_dir} must hold a JSON object", file="MODEL_DIR")
    if problem := architecture_problem(config, model_dir):
        raise InputError(problem, file="MODEL_DIR")
    limit = config.get("max_position_embeddings")
    return min(DEFAULT_SEQ_LEN, limit) if isinstance(limit, int) and limit > 0 else DEFAULT_SEQ_LEN


def starter_spec(out: Path, profile: str, prof: ClusterProfile, model_dir: Path | None, data: str | None,
                 method: str = "sft") -> str:
    """The spec text; the model path absolute, the data path as given or data.jsonl beside the spec."""
    env = jinja2.Environment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True, autoescape=False)
    env.filters["yaml"] = json.dumps  # a JSON string is a YAML scalar: any path or name stays one value
    text = resources.files("fsdpjob.templates").joinpath("starter.yaml.j2").read_text(encoding="utf-8")
    cpu = prof.gpus_per_node == 0
    seq_len = _seq_len(model_dir)
    return env.from_string(text).render(
        out=shlex.quote(str(out)), name=job_name(out), profile=profile, profile_name=prof.name,
        profile_description=" ".join(prof.description.split()),
        cpu=cpu, gpus=prof.gpus_per_node, tasks=min(2, prof.cpus_per_node or 1),
        model_path=str(model_dir) if model_dir else PLACEHOLDER_MODEL,
        model_note="a local Hugging Face model folder" if model_dir else "CHANGE ME: a local Hugging Face model folder",
        data_path=data or "data.jsonl", seq_len=seq_len, method=method,
        max_new_tokens=max(1, min(GRPO_NEW_TOKENS, seq_len // 2)),  # half the room at most: prompts get the rest
    )
