"""The training method (``train.method``) and the section of options each preference method reads.

``sft`` is supervised fine-tuning (the default). The preference methods train on pairs or labelled answers, with
TRL's names for their options and losses so that a recipe carries over:
- ``dpo``: Direct Preference Optimization against a frozen reference (cached log-probabilities by default);
- ``orpo``: odds-ratio preference optimization, no reference;
- ``kto``: unpaired answers labelled desirable or undesirable, against a reference;
- ``reward``: a Bradley-Terry reward model (a scalar head on the backbone), exported as a sequence classifier.
A method's section (``dpo:``, ``orpo:``, ``kto:``, ``reward:``) may be left out for its defaults; a section of
another method is refused (it would silently do nothing).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from .validation import Strict, field_error

Method = Literal["sft", "dpo", "orpo", "kto", "reward"]
PREFERENCE_METHODS = ("dpo", "orpo", "kto", "reward")  # trained on pairs or labelled answers, not token streams
PAIRED_METHODS = ("dpo", "orpo", "reward")  # a chosen and a rejected answer per prompt
Reference = Literal["cached", "live"]
Positive = Annotated[float, Field(strict=True, gt=0)]
DPO_LOSSES = ("sigmoid", "ipo", "hinge", "robust", "sigmoid_norm")


class DpoSpec(Strict):
    beta: Positive = 0.1
    """How far the policy may move from the reference (TRL's beta): higher keeps it closer."""
    loss_type: Literal["sigmoid", "ipo", "hinge", "robust", "sigmoid_norm"] = "sigmoid"
    ("TRL's loss names: sigmoid (the DPO paper), ipo, hinge (SLiC), robust (noise-robust DPO, with label_smoothing), "
     "sigmoid_norm (sigmoid on length-normalised log-probabilities).")
    label_smoothing: Annotated[float, Field(strict=True, ge=0, lt=0.5)] = 0.0
    """Assumed share of pairs whose preference is flipped (cDPO for sigmoid, robust DPO for robust)."""
    rpo_alpha: Annotated[float, Field(strict=True, gt=0)] | None = None
    """Weight of an SFT term on the chosen answer (TRL's rpo_alpha; the RPO paper uses 1.0); none: no SFT term."""
    reference: Reference = "cached"
    ("cached: the reference's log-probabilities of every example computed once, before the first step, by the same "
     "ranks, and kept in the run folder (no second model in memory while training). live: a frozen sharded copy "
     "of the model computes them at every step. With LoRA the reference is the base with the adapters off.")


class OrpoSpec(Strict):
    beta: Positive = 0.1
    """Weight of the odds-ratio term beside the SFT loss on the chosen answer (the paper's lambda; TRL's beta)."""


class KtoSpec(Strict):
    beta: Positive = 0.1
    """How far the policy may move from the reference."""
    desirable_weight: Positive = 1.0
    """Weight of the desirable answers' losses (raise it when they are the fewer)."""
    undesirable_weight: Positive = 1.0
    """Weight of the undesirable answers' losses."""
    reference: Reference = "cached"
    """cached or live, as for dpo."""


class RewardSpec(Strict):
    margin_field: str | None = None
    ("A field of each pair with a margin the chosen score must beat the rejected by (Llama 2's margin loss); "
     "none: no margin.")


SECTIONS: dict[str, type[Strict]] = {"dpo": DpoSpec, "orpo": OrpoSpec, "kto": KtoSpec, "reward": RewardSpec}


def check_method_sections(method: str, sections: dict[str, Strict | None]) -> None:
    """A section of a method the job does not train with is an error: its options would do nothing."""
    for name, section in sections.items():
        if section is not None and name != method:
            raise field_error(name, f"this section configures method {name}, but train.method is {method}; "
                                    f"set train.method: {name} or drop the {name} section")


def method_options(method: str, sections: dict[str, Strict | None]) -> Strict | None:
    """The options of ``method``: its section, or its defaults where the spec leaves the section out."""
    if method not in SECTIONS:
        return None
    return sections.get(method) or SECTIONS[method]()


# What each preference method reads from a record where the data section names no field of its own: TRL's names.
DEFAULT_FIELDS = {"dpo": {"prompt_field": "prompt", "chosen_field": "chosen", "rejected_field": "rejected"},
                  "kto": {"prompt_field": "prompt", "completion_field": "completion", "label_field": "label"}}
DEFAULT_FIELDS["orpo"] = DEFAULT_FIELDS["reward"] = DEFAULT_FIELDS["dpo"]


def with_method_fields(raw: Any) -> Any:
    """The raw spec with a preference method's defaults filled in: its field names where its data section sets no
    field (a ``prompt_field: null`` written out stays: a conversation's implicit prompt), and no packing."""
    if not isinstance(raw, dict) or not isinstance(raw.get("train"), dict) or not isinstance(raw.get("data"), dict):
        return raw
    method = raw["train"].get("method")
    defaults = DEFAULT_FIELDS.get(method) if isinstance(method, str) else None  # a wrong type: pydantic says so
    data = raw["data"]
    if defaults is None:
        return raw
    # Unset is missing or null (a dumped spec writes every field); prompt_field only when missing: a null written
    # out is the implicit prompt.
    fill = {} if any(data.get(k) is not None for k in defaults if k != "prompt_field") else {
        k: v for k, v in defaults.items() if k != "prompt_field" or k not in data}
    return {**raw, "data": {**data, **fill, "packing": data.get("packing", False)}}


# Methods the spec knows whose training is not built yet: refused at validate, never on a node.
NOT_YET: dict[str, str] = {}


def check_method_model(method: str, lora: Any) -> None:
    """A reward model is trained in full: its new head and the export as a sequence classifier have no LoRA form."""
    if method == "reward" and lora is not None:
        raise field_error("model.lora", "a reward model is trained in full in this version; drop model.lora")


def check_method_data(method: str, data: Any) -> None:
    """The data section fits the method: pairs for dpo, orpo and reward, labelled answers for kto, token streams
    for sft; pairs are not packed (both answers of a pair go through the same micro-batch, one row each)."""
    wants = {"dpo": "preference", "orpo": "preference", "reward": "preference", "kto": "unpaired"}.get(method)
    if wants is None:
        if data.shape in ("preference", "unpaired"):
            field = "chosen_field" if data.shape == "preference" else "label_field"
            raise field_error(f"data.{field}", f"{field} is for preference training, but train.method is sft; set "
                                               "train.method (dpo, orpo, kto or reward) or drop the field")
        return
    if method in NOT_YET:
        raise field_error("train.method", f"{method} is not supported in this version yet ({NOT_YET[method]}); "
                                          "use dpo or orpo")
    what = "chosen_field and rejected_field" if wants == "preference" else "completion_field and label_field"
    rows = "pairs" if wants == "preference" else "labelled answers"
    if data.shape != wants:
        raise field_error("data", f"{method} trains on {rows}; set data.{what} (or leave every field unset for TRL's "
                                  "names)")
    # A mixture's source that sets fields of its own reads them instead of the section's: the same shape too.
    for index, source in enumerate(data.sources or ()):
        if source.sets_fields and source.shape != wants:
            raise field_error(f"data.sources.{index}", f"{method} trains on {rows}, and this source's own fields "
                                                       f"read another shape; set its {what} (and prompt_field), or "
                                                       "none of its own")
    if data.packing is not False:
        raise field_error("data.packing", f"{method} does not pack: each answer is its own row, padded to "
                                          "seq_len (a pair's two answers in the same micro-batch); set packing: "
                                          "false or drop it")
    if data.long_examples == "split":
        raise field_error("data.long_examples", "an answer cannot be split from its prompt; use truncate (the "
                                                "answer's end is cut) or drop")
