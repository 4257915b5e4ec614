"""The spec's data section (DataSpec, part of spec.py's JobSpec): which fields hold an example, the formats,
one source of a mixture and the rules of the list. The worker and the login-node checks read every source the
same way, through ``DataSpec.inputs()``: each source with what it leaves unset taken from the section."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from .validation import Strict, field_error, path_value

DataFormat = Literal["auto", "jsonl", "parquet", "save_to_disk"]
FIELD_KEYS = ("text_field", "prompt_field", "completion_field", "messages_field", "chosen_field", "rejected_field",
              "label_field")
Shape = Literal["text", "prompt_completion", "chat", "preference", "unpaired", "prompts"]
# Weights are shares: written as decimals they rarely add up to exactly 1 in binary floating point.
WEIGHT_TOLERANCE = 1e-6


class FieldOptions:
    """Which fields of a record (a JSON line, a table row) make the example: plain text, a prompt/completion
    pair or chat messages. Mixed into the pydantic models that declare the four ``*_field`` attributes (not
    declared here: pydantic would take annotations of a base class for fields of its own)."""

    def shape_problem(self) -> str | None:
        if self.chosen_field is not None or self.rejected_field is not None:
            return self._pair_problem()
        if self.label_field is not None:
            if self.completion_field is None or self.text_field is not None or self.messages_field is not None:
                return "label_field takes prompt_field and completion_field (unlabelled answers, for kto)"
            return None
        shapes = [
            name
            for name, on in (
                ("text_field", self.text_field is not None),
                ("prompt_field/completion_field", self.prompt_field is not None or self.completion_field is not None),
                ("messages_field", self.messages_field is not None),
            )
            if on
        ]
        if len(shapes) > 1:
            return f"give one data shape, not {' and '.join(shapes)}"
        if self.completion_field is not None and self.prompt_field is None:
            return "completion_field goes with prompt_field; set both"
        return None  # a prompt alone is grpo's shape (prompts to generate for); other methods refuse it

    def _pair_problem(self) -> str | None:
        if self.chosen_field is None or self.rejected_field is None:
            return "chosen_field and rejected_field go together (a preference pair); set both"
        others = [k for k in ("text_field", "completion_field", "messages_field", "label_field")
                  if getattr(self, k) is not None]
        if others:
            return f"a preference pair takes prompt_field, chosen_field and rejected_field, not {others[0]}"
        return None

    @property
    def sets_fields(self) -> bool:
        return any(getattr(self, key) is not None for key in FIELD_KEYS)

    @property
    def shape(self) -> Shape:
        if self.chosen_field is not None:
            return "preference"
        if self.label_field is not None:
            return "unpaired"
        if self.prompt_field is not None:
            return "prompt_completion" if self.completion_field is not None else "prompts"
        if self.messages_field is not None:
            return "chat"
        return "text"

    @property
    def fields(self) -> dict[str, str]:
        """The record's field for each role (text; prompt and completion; messages; prompt, chosen and rejected,
        the prompt left out where the pairs carry it in their conversations; prompt, completion and label)."""
        if self.shape == "preference":
            prompt = {"prompt": self.prompt_field} if self.prompt_field is not None else {}
            return {**prompt, "chosen": self.chosen_field, "rejected": self.rejected_field}  # type: ignore[dict-item]
        if self.shape == "unpaired":
            return {"prompt": self.prompt_field, "completion": self.completion_field,  # type: ignore[dict-item]
                    "label": self.label_field}
        if self.shape == "prompt_completion":
            return {"prompt": self.prompt_field, "completion": self.completion_field}  # type: ignore[dict-item]
        if self.shape == "prompts":
            return {"prompt": self.prompt_field}  # type: ignore[dict-item]
        if self.shape == "chat":
            return {"messages": self.messages_field}  # type: ignore[dict-item]
        return {"text": self.text_field or "text"}


class DataSource(FieldOptions, Strict):
    """One source of a data mixture."""

    # A long field docstring is one parenthesized string, no newline in it: the schema's description keeps its text.
    path: str
    ("JSONL file(s), parquet file(s) or a folder written by datasets' save_to_disk: a file, a folder or a glob such as "
     "data/*.parquet. Relative to the spec file.")
    weight: Annotated[float, Field(strict=True, gt=0, le=1)]
    ("Share of the training sequences drawn from this source; the weights of all sources add up to 1. A small source "
     "is repeated, a large one is cycled through over the epochs.")
    format: DataFormat | None = None
    """Format of path; default: data.format."""
    split: str | None = None
    """Split of a save_to_disk folder that holds a DatasetDict; default: data.split."""
    text_field: str | None = None
    """Field with plain text; a source that sets any field uses its own fields instead of data's."""
    prompt_field: str | None = None
    """Field with the prompt of a prompt/completion pair (set with completion_field)."""
    completion_field: str | None = None
    """Field with the completion of a prompt/completion pair."""
    messages_field: str | None = None
    """Field with chat messages [{role, content}, ...]."""
    chosen_field: str | None = None
    """Field with a preference pair's chosen answer."""
    rejected_field: str | None = None
    """Field with a preference pair's rejected answer."""
    label_field: str | None = None
    """Field with an answer's desirable (true) or undesirable (false) label (kto)."""

    _path = field_validator("path")(path_value)

    @model_validator(mode="after")
    def _one_shape(self) -> DataSource:
        if problem := self.shape_problem():
            raise ValueError(problem)
        return self


def check_sources(sources: list[DataSource]) -> str | None:
    """What is wrong with a mixture's list as a whole (the sources themselves are validated already)."""
    if not sources:
        return "give at least one source (path and weight), or use data.path instead of data.sources"
    total = sum(s.weight for s in sources)
    if abs(total - 1) > WEIGHT_TOLERANCE:
        terms = " + ".join(f"{s.weight:g}" for s in sources)
        scaled = ", ".join(f"{s.weight / total:.4g}" for s in sources)
        return (f"the weights add up to {total:g} ({terms}); each is the share of training sequences drawn from "
                f"its source, so they must add up to 1: e.g. {scaled}")
    paths = [s.path for s in sources]
    if twice := sorted({p for p in paths if paths.count(p) > 1}):
        return f"{twice[0]} is listed twice; give each source once, with the sum of its weights"
    return None


def with_defaults(source: DataSource, defaults: DataSpec) -> DataSource:
    """``source`` with what it leaves unset taken from ``defaults`` (the data section): format, split and,
    unless it sets any field of its own, the field options."""
    update: dict[str, Any] = {}
    if source.format is None:
        update["format"] = defaults.format
    if source.split is None:
        update["split"] = defaults.split
    if not source.sets_fields:
        update.update({key: getattr(defaults, key) for key in FIELD_KEYS})
    return source.model_copy(update=update)


class DataSpec(FieldOptions, Strict):
    path: str | None = None
    ("Training data: a JSONL file, parquet files (a file, a folder or a glob such as data/*.parquet) or a folder "
     "written by datasets' save_to_disk. Relative to the spec file. Give path or sources.")
    format: DataFormat = "auto"
    ("Format of path, eval_path and every source without its own: jsonl, parquet or save_to_disk; auto: parquet for "
     ".parquet files (or a folder or glob of them), save_to_disk for a folder with dataset_info.json or "
     "dataset_dict.json, JSONL otherwise.")
    split: str | None = None
    ("Split to train on when the data is a save_to_disk folder holding a DatasetDict; default: train, or its only "
     "split.")
    sources: list[DataSource] | None = None
    ("A mixture instead of path: sources, each {path, weight} and optionally its own format, split and field options; "
     "the weights add up to 1.")
    text_field: str | None = None
    """Field with plain text (loss on every token). The default shape when no other field is given: 'text'."""
    prompt_field: str | None = None
    """Field with the prompt of a prompt/completion pair (no loss on prompt tokens)."""
    completion_field: str | None = None
    """Field with the completion of a prompt/completion pair."""
    messages_field: str | None = None
    ("Field with chat messages [{role, content}, ...], rendered with the tokenizer's chat template; loss on assistant "
     "turns only.")
    chosen_field: str | None = None
    ("Field with a preference pair's chosen answer (dpo, orpo, reward; default there: chosen): a string, or assistant "
     "messages when the prompt is messages. Without a prompt field the pair's prompt is the messages the chosen and "
     "rejected conversations share (TRL's implicit prompt).")
    rejected_field: str | None = None
    """Field with a preference pair's rejected answer (default for preference methods: rejected)."""
    label_field: str | None = None
    """Field with an answer's desirable (true) or undesirable (false) label (kto; default there: label)."""
    seq_len: Annotated[int, Field(strict=True, gt=0)] = 512
    """Tokens per sequence."""
    packing: bool | Literal["naive"] = True
    ("true: pack whole examples into each sequence along their boundaries (best-fit decreasing), each example with its "
     "own positions and attention to itself only. naive: concatenate every example and cut at seq_len (examples attend "
     "to the ones before them and may lose their start; the behaviour before boundary-aware packing). false: one "
     "example per sequence, padded to seq_len.")
    long_examples: Literal["truncate", "split", "drop"] = "truncate"
    ("Examples longer than seq_len (packing true or false): truncate keeps their first seq_len tokens, split cuts them "
     "into seq_len chunks (each its own example, positions from 0), drop leaves them out.")
    shuffle: bool = True
    """Shuffle examples deterministically from train.seed."""
    eval_path: str | None = None
    """Evaluation examples, in any format path takes, with the same fields as path. Relative to the spec file."""
    eval_split: str | None = None
    ("Split of eval_path when it is a save_to_disk DatasetDict folder; default: validation, else test, else its only "
     "split.")
    eval_fraction: Annotated[float, Field(strict=True, ge=0, lt=1)] = 0.0
    """Share of the packed training sequences held out for evaluation (chosen from train.seed); 0: none."""

    _path = field_validator("path", "eval_path")(path_value)

    @model_validator(mode="after")
    def _one_shape(self) -> DataSpec:
        if problem := self.shape_problem():
            raise ValueError(problem)
        if (self.path is None) == (self.sources is None):
            raise field_error("path", "give path (one data set) or sources (a mixture), one of them")
        if self.sources is not None and (problem := check_sources(self.sources)):
            raise field_error("sources", problem)
        if self.eval_path is not None and self.eval_fraction:
            raise field_error("eval_fraction", "give eval_path or eval_fraction, not both; drop one of them")
        if self.packing == "naive" and self.long_examples != "truncate":
            raise field_error("long_examples", "naive packing cuts the stream of examples wherever a sequence ends; "
                              "long_examples applies to packing true or false")
        if self.eval_split is not None and self.eval_path is None:
            raise field_error("eval_split", "eval_split names a split of eval_path; set eval_path or drop eval_split")
        return self

    @property
    def has_eval(self) -> bool:
        return self.eval_path is not None or self.eval_fraction > 0

    def inputs(self) -> list[DataSource]:
        """The training sources with what they leave unset taken from this section: ``path`` as one source of
        weight 1, or each of ``sources``."""
        if self.sources is None:
            only = {"path": self.path, "weight": 1.0, **{key: getattr(self, key) for key in FIELD_KEYS}}
            return [DataSource.model_validate(only | {"format": self.format, "split": self.split})]
        return [with_defaults(source, self) for source in self.sources]
