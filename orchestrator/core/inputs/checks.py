"""Login-node checks of the model folder and data a spec names (the data in dataformats.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fsdpjob.orchestrator.core.errors import InputError
from fsdpjob.orchestrator.core.jobspec.families import SUPPORTED_MODEL_TYPES, logit_transform

from .dataformats import RowError, SourceProblem, check_data, check_not_all_dropped, locate, source_records
from .promptroom import check_prompt_room
from .records import SCAN_LINES
from .rewardfns import check_reward_functions

if TYPE_CHECKING:
    from fsdpjob.orchestrator.core.jobspec.spec import DataSpec, JobSpec
    from fsdpjob.orchestrator.core.jobspec.yamlio import YamlDoc


def _read_config(folder: Path, doc: YamlDoc | None) -> dict[str, Any]:
    loc = ("model", "path")
    if not folder.exists():
        message = f"model folder {folder} does not exist; point model.path at a local Hugging Face model folder"
        raise InputError.at(doc, loc, message)
    if not folder.is_dir():
        raise InputError.at(doc, loc, f"{folder} is not a folder; model.path must be a Hugging Face model folder")
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise InputError.at(doc, loc, f"no config.json in {folder}; is this a Hugging Face model folder?")
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise InputError(f"config.json is not valid JSON ({exc.msg})", file=str(config_file), line=exc.lineno) from None
    if not isinstance(config, dict):
        raise InputError("config.json must hold a JSON object", file=str(config_file), line=1)
    return config


def architecture_problem(config: dict[str, Any], folder: Path) -> str | None:
    """Why fsdpjob cannot train the model of this config.json (``fsdpjob init`` says it too), or None."""
    model_type = config.get("model_type")
    archs = config.get("architectures") or []
    if model_type not in SUPPORTED_MODEL_TYPES:
        return (f"model_type {model_type!r} in {folder / 'config.json'} is not supported: fsdpjob trains decoder-only "
                f"causal LMs of these families: {', '.join(SUPPORTED_MODEL_TYPES)}; use a model of one of them (or a "
                "checkpoint converted to one), or add the family after checking that its decoder blocks are in its "
                "_no_split_modules")
    if archs and not any(str(a).endswith(("ForCausalLM", "LMHeadModel")) for a in archs):  # GPT2LMHeadModel
        return (f"architectures {archs} in {folder / 'config.json'} name no *ForCausalLM (or *LMHeadModel); fsdpjob "
                "fine-tunes causal LMs")
    return None


def _check_architecture(config: dict[str, Any], folder: Path, doc: YamlDoc | None) -> None:
    if problem := architecture_problem(config, folder):
        raise InputError.at(doc, ("model", "path"), problem)


def _check_weights(folder: Path, doc: YamlDoc | None) -> None:
    loc = ("model", "path")
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = set(json.loads(index.read_text(encoding="utf-8")).get("weight_map", {}).values())
        except (json.JSONDecodeError, AttributeError):
            message = "not a valid safetensors index (JSON with a weight_map)"
            raise InputError(message, file=str(index), line=1) from None
        missing = sorted(s for s in shards if not (folder / s).is_file())
        if missing:
            message = f"{index.name} names {len(missing)} missing shard(s), e.g. {missing[0]}: the download is partial"
            raise InputError.at(doc, loc, message)
        return
    if any(folder.glob("*.safetensors")):
        return
    if any(folder.glob("*.bin")):
        raise InputError.at(
            doc,
            loc,
            f"{folder} has only PyTorch .bin weights; convert them to safetensors "
            "(from_pretrained, then save_pretrained(dir, safe_serialization=True))",
        )
    raise InputError.at(doc, loc, f"no weights in {folder} (*.safetensors or model.safetensors.index.json): download "
                                  "them first; before that, `fsdpjob plan` needs only config.json and "
                                  "--no-file-checks skips these checks (validate, render, submit --dry-run)")


def _check_tokenizer(folder: Path, data: DataSpec, doc: YamlDoc | None) -> None:
    has = {name for name in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json", "merges.txt")
           if (folder / name).is_file()}  # fmt: skip
    if not ({"tokenizer.json"} <= has or {"tokenizer.model", "tokenizer_config.json"} <= has
            or {"vocab.json", "merges.txt"} <= has):  # fmt: skip
        raise InputError.at(
            doc,
            ("model", "path"),
            f"no tokenizer in {folder}: need tokenizer.json (or tokenizer.model with tokenizer_config.json); "
            "save the tokenizer next to the model with save_pretrained",
        )
    if any(source.shape == "chat" for source in data.inputs()) and not _has_chat_template(folder):
        raise InputError.at(
            doc,
            ("data", "messages_field"),
            f"data.messages_field needs a chat template, and the tokenizer in {folder} has none; "
            "use text_field or prompt_field/completion_field, or add a chat template",
        )


def _check_conversation_pairs(data: DataSpec, folder: Path) -> None:
    """Preference data given as conversations needs the model's chat template: the first such record of the first
    SCAN_LINES of each source, at its FILE:LINE, when the tokenizer has none (the workers would stop there)."""
    if _has_chat_template(folder):
        return
    for source in data.inputs():
        if source.shape not in ("preference", "unpaired"):
            continue
        try:
            records = source_records(locate(source), source, limit=SCAN_LINES)
            for file, line, fields in records:
                role = next((r for r in ("prompt", "chosen", "completion") if isinstance(fields.get(r), list)), None)
                if role is not None:
                    raise InputError(f"field {source.fields[role]!r}: the record is a conversation, and the "
                                     f"tokenizer in {folder} has no chat template to render it; give strings or add "
                                     "a chat template", file=str(file), line=line)
        except (SourceProblem, RowError):
            continue  # check_data reports these


def _has_chat_template(folder: Path) -> bool:
    if (folder / "chat_template.jinja").is_file() or (folder / "chat_template.json").is_file():
        return True
    try:
        config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return False
    return isinstance(config, dict) and bool(config.get("chat_template"))


def _check_seq_len(config: dict[str, Any], data: DataSpec, folder: Path, doc: YamlDoc | None) -> None:
    limit = config.get("max_position_embeddings")
    if isinstance(limit, int) and data.seq_len > limit:
        raise InputError.at(
            doc,
            ("data", "seq_len"),
            f"data.seq_len {data.seq_len} is beyond the model's max_position_embeddings {limit} "
            f"({folder / 'config.json'}); use at most {limit}",
        )


def _check_loss(config: dict[str, Any], spec: JobSpec, folder: Path, doc: YamlDoc | None) -> None:
    """train.loss: chunked calls lm_head itself: a model that transforms its logits after it cannot use it."""
    if spec.train.loss == "chunked" and (transform := logit_transform(config)) is not None:
        raise InputError.at(doc, ("train", "loss"), f"the chunked loss would skip the {transform} this model "
                                                    f"applies to its logits ({folder / 'config.json'}); set "
                                                    "train.loss: standard or auto")


def check_inputs(spec: JobSpec, doc: YamlDoc | None = None, *, config_only: bool = False) -> None:
    """Raise InputError for the problems with the model folder and data file, all of them (SpecErrors when there
    are several, one line each); ``doc`` gives spec lines.

    ``config_only`` (``fsdpjob plan``, before the download): only config.json is read; the weights, the
    tokenizer and the data file are not checked (the plan needs none of them; validate and submit do).
    """
    found: list[InputError] = []

    def attempt(check, *args) -> None:
        try:
            check(*args)
        except InputError as exc:
            found.extend(getattr(exc, "errors", None) or [exc])  # SpecErrors holds several

    folder = Path(spec.model.path)
    try:
        config = _read_config(folder, doc)
    except InputError as exc:
        found.append(exc)
    else:
        attempt(_check_architecture, config, folder, doc)
        if not config_only:
            attempt(_check_weights, folder, doc)
            attempt(_check_tokenizer, folder, spec.data, doc)
        attempt(_check_seq_len, config, spec.data, folder, doc)
        attempt(_check_loss, config, spec, folder, doc)
    if not config_only:
        attempt(check_data, spec.data, doc, getattr(spec.method_options, "margin_field", None))
        attempt(check_not_all_dropped, spec.data, folder, doc)
        attempt(_check_conversation_pairs, spec.data, folder)
        attempt(check_prompt_room, spec.data, folder, getattr(spec.method_options, "max_new_tokens", None))
        attempt(check_reward_functions, spec, doc)  # grpo's: they load here, without torch
    if len(found) == 1:
        raise found[0]
    if found:
        from fsdpjob.orchestrator.core.jobspec.validation import SpecErrors

        raise SpecErrors(found)
