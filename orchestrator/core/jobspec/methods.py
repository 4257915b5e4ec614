"""The training method (``train.method``) and the section of options each preference method reads.

``sft`` is supervised fine-tuning (the default). The preference methods train on pairs or labelled answers, with
TRL's names for their options and losses so that a recipe carries over:
- ``dpo``: Direct Preference Optimization against a frozen reference (cached log-probabilities by default);
- ``orpo``: odds-ratio preference optimization, no reference;
- ``kto``: unpaired answers labelled desirable or undesirable, against a reference;
- ``reward``: a Bradley-Terry reward model (a scalar head on the backbone), exported as a sequence classifier;
- ``grpo``: reinforcement learning with verifiable rewards (group relative policy optimization): the ranks generate
  completions for prompts, the user's reward functions score them, the policy trains on the group-normalised
  advantages (TRL's GRPOTrainer's names and losses).
A method's section (``dpo:``, ``orpo:``, ``kto:``, ``reward:``) may be left out for its defaults (``grpo:`` names its
reward functions, so it is required); a section of another method is refused (it would silently do nothing).

``METHODS`` is the login side's table of methods, one frozen ``MethodFacts`` row each (as ``families.FAMILIES`` is
for model families): its section, its data shape and field defaults, its reference, whether SFT's chunked loss
applies, its rows per example, its generation, its export kind and its goodput phases. The spec checks, the planner
and ``fsdpjob init`` read the row, never the method's name.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from .validation import Strict, field_error

Method = Literal["sft", "dpo", "orpo", "kto", "reward", "grpo"]
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

    @field_validator("loss_type", mode="before")
    @classmethod
    def _one_loss(cls, value: Any) -> Any:
        """TRL's list form ([sigmoid, sft] with loss_weights) and its sft loss: say what fsdpjob calls them."""
        sft = ("TRL's sft loss beside a DPO loss is fsdpjob's dpo.rpo_alpha, the weight of the SFT term on the "
               "chosen answers")
        others = set(value) - {"sft"} if isinstance(value, list) and "sft" in value else None
        if others is not None and len(value) == 2 and len(others) == 1 and others <= set(DPO_LOSSES):
            raise ValueError(f"one loss_type: {sft}; set loss_type: {others.pop()} and rpo_alpha: the sft loss's "
                             "weight (TRL's loss_weights [1, alpha]; 1.0 without loss_weights)")
        if isinstance(value, list):
            raise ValueError(f"one loss_type, not a list: fsdpjob combines no losses ({sft}); give one of "
                             f"{', '.join(DPO_LOSSES)}")
        if value == "sft":
            raise ValueError(f"sft is no DPO loss: {sft}; alone it is train.method: sft")
        return value

    @model_validator(mode="after")
    def _smoothing_where_used(self) -> DpoSpec:
        if self.label_smoothing and self.loss_type not in ("sigmoid", "robust"):
            raise field_error("label_smoothing", f"loss_type {self.loss_type} has no label smoothing (cDPO is "
                                                 "sigmoid's, robust DPO robust's): it would be ignored; drop "
                                                 "label_smoothing or use loss_type sigmoid or robust")
        return self


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


# path/to/file.py:function (relative to the spec file) or dotted.module:function
REWARD_FUNCTION = re.compile(r"(?P<where>[^:\x00]+\.py|[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*)"
                             r":(?P<name>[A-Za-z_][A-Za-z0-9_]*)")


class RewardFunctionSpec(Strict):
    function: str
    ("path/to/file.py:function (relative to the spec file) or module:function. Called as TRL's reward functions are: "
     "function(prompts=[...], completions=[...], **fields) with every other field of the prompts' records as a list, "
     "returning one float per completion.")
    weight: Annotated[float, Field(strict=True)] = 1.0
    """Weight of this function's reward in the sum each completion is trained on."""

    @field_validator("function")
    @classmethod
    def _form(cls, value: str) -> str:
        if not REWARD_FUNCTION.fullmatch(value):
            raise ValueError(f"{value!r} is not path/to/file.py:function or module:function; e.g. "
                             "rewards.py:exact_answer")
        return value

    @property
    def name(self) -> str:
        """The function's name (metrics: rewards/<name>/mean and /std)."""
        return value_name(self.function)


def value_name(function: str) -> str:
    return function.rsplit(":", 1)[1]


class GeneratorSpec(Strict):
    backend: Literal["inprocess", "vllm"] = "inprocess"
    ("inprocess: the training ranks generate with the policy they train, in lockstep (no gather of the whole model on "
     "one rank; for small models). vllm: vLLM's OpenAI server runs as its own step of the same Slurm job on `nodes` of "
     "its nodes, from `python` (an environment with vLLM: .ci/vllm-env builds one), and serves each new policy "
     "before the next generation (full weights reloaded from a folder, or LoRA adapters loaded in place).")
    nodes: Annotated[int, Field(strict=True, gt=0)] = 1
    ("Nodes of the allocation that run the generation server (backend: vllm); the others train. One server runs, on "
     "one node (its GPUs as data-parallel engines of tensor_parallel_size each): more is refused for now.")
    deadline_s: Annotated[int, Field(strict=True, gt=0)] = 600
    ("Bound on each request to the server (backend: vllm; vLLM sends nothing before its answer, so it bounds the "
     "whole request: give it the longest round's time): a request or weight load not answered within it makes the "
     "rank report the server lost; the supervisor replaces the server while the training step waits, and the rank "
     "asks again (generator-only recovery), never an endless wait.")
    python: str | None = None
    ("The interpreter that runs the vLLM server: one whose environment has vLLM (default: this package's own); "
     "with mode colocate, the interpreter the training workers run (vLLM and fsdpjob).")
    tensor_parallel_size: Annotated[int, Field(strict=True, gt=0)] = 1
    """vLLM's tensor-parallel degree on GPUs (within a node)."""
    gpu_memory_utilization: Annotated[float, Field(strict=True, gt=0, le=1)] = 0.9
    """The share of each GPU's memory vLLM takes (weights and KV cache)."""
    gpus_per_node: Annotated[int, Field(strict=True, ge=0)] | None = None
    """GPUs of each generator node the server uses (default: the profile's gpus_per_node; 0 on CPU)."""
    max_model_len: Annotated[int, Field(strict=True, gt=0)] | None = None
    """vLLM's context length (prompt + completion); default data.seq_len."""
    mode: Literal["server", "colocate"] = "server"
    ("backend vllm: server (vLLM's OpenAI server as its own step) or colocate (TRL's vllm_mode colocate): a "
     "vLLM engine inside each training rank, which generates that rank's prompts; no server step, no nodes of its "
     "own. The workers then run `python` (an environment with vLLM and fsdpjob: the vLLM image or venv with fsdpjob "
     "installed; default the launch's own interpreter, which must have vLLM), each round with a new policy copies "
     "its weights into the engine in memory (LoRA: the adapters only), and on GPUs the engine sleeps (weights and "
     "KV cache released) while the ranks train. gpu_memory_utilization is then the engine's share of each training "
     "GPU; nodes, gpus_per_node, deadline_s and tensor_parallel_size > 1 do not apply.")

    @model_validator(mode="after")
    def _colocate(self) -> GeneratorSpec:
        if self.mode != "colocate":
            return self
        if self.backend != "vllm":
            raise field_error("mode", f"colocate is a mode of vLLM's engine, not of backend {self.backend}; set "
                                      "backend: vllm, or drop mode")
        if self.tensor_parallel_size != 1:
            raise field_error("tensor_parallel_size", "a colocated engine runs on its training rank's own device: "
                                                      "tensor_parallel_size must be 1; use mode: server for a model "
                                                      "that needs tensor parallelism")
        # Against the defaults, not the fields set: the run folder's resolved spec writes every field.
        for name in ("nodes", "gpus_per_node", "deadline_s"):
            if getattr(self, name) != GeneratorSpec.model_fields[name].default:
                raise field_error(name, f"{name} is a generation server's; a colocated engine runs inside the "
                                        "training ranks (mode: colocate): drop it")
        return self

    @property
    def colocated(self) -> bool:
        """vLLM inside each training rank (no server step)."""
        return self.backend == "vllm" and self.mode == "colocate"

    @property
    def server(self) -> bool:
        """A generation server runs as a step of its own (vllm in server mode)."""
        return self.backend == "vllm" and not self.colocated

    @field_validator("backend", mode="before")
    @classmethod
    def _retired(cls, value: Any) -> Any:
        if value == "server":  # the home-made transformers server, one completion at a time: retired (issue 52)
            raise ValueError("backend server (the home-made transformers server) was retired; use vllm (or "
                             "inprocess for small models)")
        return value


class GrpoSpec(Strict):
    reward: Annotated[list[RewardFunctionSpec], Field(min_length=1)]
    """The reward functions: [{function: rewards.py:exact_answer, weight: 1.0}, ...] (a plain string: weight 1)."""
    num_generations: Annotated[int, Field(strict=True, ge=2)] = 8
    ("Completions per prompt (the group whose rewards are normalised); divides train.micro_batch_size x "
     "train.grad_accum_steps, the completions each rank trains on per step.")
    max_new_tokens: Annotated[int, Field(strict=True, gt=0)] = 256
    """Tokens generated per completion at most (TRL's max_completion_length); prompts get seq_len minus this."""
    temperature: Positive = 1.0
    """Sampling temperature."""
    top_p: Annotated[float, Field(strict=True, gt=0, le=1)] = 1.0
    """Nucleus sampling: the smallest set of tokens whose probabilities add up to top_p."""
    beta: Annotated[float, Field(strict=True, ge=0)] = 0.0
    """KL penalty to the reference (the starting model); 0: no reference model (TRL's default)."""
    epsilon: Positive = 0.2
    """Clip range of the importance ratio (lower and, without epsilon_high, upper)."""
    epsilon_high: Positive | None = None
    """Upper clip range (DAPO's clip-higher); none: epsilon."""
    loss_type: Literal["grpo", "dr_grpo", "dapo", "bnpo"] = "dapo"
    ("TRL's names: grpo (each completion's mean over its tokens, then the mean over completions), dr_grpo (sum over "
     "tokens divided by completions x max_new_tokens), dapo (sum over the global batch's tokens divided by their "
     "count; TRL's default), bnpo (as dapo, over this rank's tokens).")
    scale_rewards: Literal["group", "batch", "none"] = "group"
    """Divide the advantages by the standard deviation of the rewards in the group, in the batch, or not at all."""
    steps_per_generation: Annotated[int, Field(strict=True, gt=0)] = 1
    ("Optimizer steps trained on one round of generations (later steps of a round clip against the policy that "
     "generated them). Not TRL's unit: TRL's steps_per_generation counts micro-steps (default: its "
     "gradient_accumulation_steps, one optimizer step); TRL's N is N / grad_accum_steps here.")
    generator: GeneratorSpec = Field(default_factory=GeneratorSpec)
    """Where completions are generated."""
    tis_cap: Annotated[float, Field(strict=True, ge=1)] | None = 2.0
    ("Truncated importance sampling (backend vllm, whose sampler's log-probabilities come with each completion): "
     "each token's loss is weighted by min(pi_trainer / pi_sampler, tis_cap), the trainer's probability of the "
     "token under the generating policy over vLLM's; none: off. The mismatch is logged either way "
     "(sampler_kl, sampler_ratio_max).")

    @field_validator("reward", mode="before")
    @classmethod
    def _plain_names(cls, value: Any) -> Any:
        if isinstance(value, (str, dict)):
            value = [value]
        return [{"function": v} if isinstance(v, str) else v for v in value] if isinstance(value, list) else value

    @model_validator(mode="after")
    def _distinct(self) -> GrpoSpec:
        names = [r.name for r in self.reward]
        if twice := sorted({n for n in names if names.count(n) > 1}):
            raise field_error("reward", f"two reward functions are named {twice[0]} (metrics rewards/{twice[0]}/mean); "
                                        "give each a distinct name")
        return self


def workers_python(grpo: GrpoSpec | None, default: str) -> str:
    """The interpreter the training workers run: ``generator.python`` where vLLM is colocated in them (it must
    import vLLM and fsdpjob), else ``default`` (the profile's, the container's or the launch's own)."""
    if grpo is not None and grpo.generator.colocated and grpo.generator.python:
        return grpo.generator.python
    return default


# What a method reads from a record where the data section names no field of its own: TRL's names.
_PAIR_FIELDS = {"prompt_field": "prompt", "chosen_field": "chosen", "rejected_field": "rejected"}
_UNPAIRED_FIELDS = {"prompt_field": "prompt", "completion_field": "completion", "label_field": "label"}


@dataclass(frozen=True)
class MethodFacts:
    """What the login side knows of one training method (``train.method``), in one place."""

    section: type[Strict] | None = None  # its options' section (the spec's field of the method's name); None: none
    section_required: bool = False  # no defaults: the section must be written (grpo names its reward functions)
    # -- data: the shape of data.* it trains on (dataspec's DataSpec.shape; None: token streams, packed or not)
    data_shape: Literal["preference", "unpaired", "prompts"] | None = None
    fields: dict[str, str] = field(default_factory=dict)  # data field names filled in where the spec sets none
    # -- the model: a reference to stay near ("section": its section's reference, cached or live; "beta": a
    # frozen copy of the starting model while grpo.beta > 0), its LoRA form, its export
    reference: Literal["section", "beta"] | None = None
    lora: bool = True  # False: trained in full (a new head with no LoRA form)
    quantize: str | None = None  # why model.quantize (a 4-bit base) is refused with it; None: allowed
    export: Literal["causal_lm", "classifier"] = "causal_lm"
    # -- the step
    loss_reads_logits: bool = True  # its loss reads the logits itself: SFT's chunked cross-entropy does not apply
    generates: bool = False  # the ranks (or a generation server) generate completions every round
    # -- goodput: phases of its own beside the steps (runlog and goodput names)
    phases: tuple[str, ...] = ()
    # -- a method the spec knows whose training is not built yet: refused at validate with this reason
    not_yet: str | None = None

    @property
    def packs(self) -> bool:
        """Trains on token streams, packed when data.packing says so (not rows of pairs, answers or prompts)."""
        return self.data_shape is None

    @property
    def paired(self) -> bool:
        """A chosen and a rejected answer per prompt, both in the same micro-batch."""
        return self.data_shape == "preference"

    @property
    def rows_per_example(self) -> int:
        return 2 if self.paired else 1

    @property
    def chunked_loss(self) -> bool:
        """Whether train.loss: chunked (SFT's cross-entropy a chunk of tokens at a time) applies."""
        return not self.loss_reads_logits

    def reference_copy(self, options: Any) -> bool:
        """Whether training holds a frozen copy of the model beside the policy (before LoRA, whose reference is
        the base with the adapters off): ``options`` is the method's options (JobSpec.method_options)."""
        if self.reference == "section":
            return options.reference == "live"
        return self.reference == "beta" and options.beta > 0


# One row per method, in --method's order.
METHODS: dict[str, MethodFacts] = {
    "sft": MethodFacts(loss_reads_logits=False),
    "dpo": MethodFacts(DpoSpec, data_shape="preference", fields=_PAIR_FIELDS, reference="section",
                       phases=("reference",)),
    "orpo": MethodFacts(OrpoSpec, data_shape="preference", fields=_PAIR_FIELDS),
    "kto": MethodFacts(KtoSpec, data_shape="unpaired", fields=_UNPAIRED_FIELDS, reference="section",
                       phases=("reference",)),
    "reward": MethodFacts(RewardSpec, data_shape="preference", fields=_PAIR_FIELDS, lora=False, export="classifier"),
    "grpo": MethodFacts(GrpoSpec, section_required=True, data_shape="prompts", fields={"prompt_field": "prompt"},
                        reference="beta", generates=True, phases=("generation",),
                        quantize="its generation engines load the policy's weights, which have no 4-bit form there"),
}


def facts_of(method: str) -> MethodFacts:
    """``method``'s row (the spec's Method literal admits only the table's names)."""
    return METHODS[method]


def check_method_sections(method: str, sections: dict[str, Strict | None]) -> None:
    """A section of a method the job does not train with is an error: its options would do nothing."""
    if facts_of(method).section_required and sections.get(method) is None:
        raise field_error("train.method", f"{method} needs its section: add {method}: with reward: [file.py:function]"
                                          " (see fsdpjob init --method grpo)")
    for name, section in sections.items():
        if section is not None and name != method:
            raise field_error(name, f"this section configures method {name}, but train.method is {method}; "
                                    f"set train.method: {name} or drop the {name} section")


def method_options(method: str, sections: dict[str, Strict | None]) -> Strict | None:
    """The options of ``method``: its section, or its defaults where the spec leaves the section out."""
    section = facts_of(method).section
    return None if section is None else sections.get(method) or section()


def with_method_fields(raw: Any) -> Any:
    """The raw spec with a preference method's defaults filled in: its field names where its data section sets no
    field (a ``prompt_field: null`` written out stays: a conversation's implicit prompt), and no packing."""
    if not isinstance(raw, dict) or not isinstance(raw.get("train"), dict) or not isinstance(raw.get("data"), dict):
        return raw
    method = raw["train"].get("method")
    facts = METHODS.get(method) if isinstance(method, str) else None  # a wrong type or name: pydantic says so
    data, defaults = raw["data"], facts.fields if facts is not None else None
    if not defaults:
        return raw
    # Unset is missing or null (a dumped spec writes every field); prompt_field only when missing: a null written
    # out is the implicit prompt.
    fill = {} if any(data.get(k) is not None for k in defaults if k != "prompt_field") else {
        k: v for k, v in defaults.items() if k != "prompt_field" or k not in data}
    return {**raw, "data": {**data, **fill, "packing": data.get("packing", False)}}


def _check_grpo_data(data: Any) -> None:
    if data.has_eval:
        which = "eval_path" if data.eval_path is not None else "eval_fraction"
        raise field_error(f"data.{which}", "grpo has no evaluation pass in this version (its metrics are the rewards "
                                           f"of every step); drop data.{which} and train.eval_every")
    if data.shape != "prompts":
        raise field_error("data", "grpo trains on prompts: set data.prompt_field alone (or leave every field unset "
                                  "for TRL's name, prompt); the reward functions read the records' other fields")
    if data.packing is not False:
        raise field_error("data.packing", "grpo does not pack: each completion is its own row; set packing: false "
                                          "or drop it")


def check_grpo(grpo: GrpoSpec | None, train: Any, data: Any) -> None:
    """GRPO's options against the rest of the spec: a group on one rank, room for the completions (the nodes left
    to train beside a generation server depend on the profile: planner/resolve.py)."""
    if grpo is None:
        return
    per_rank = train.micro_batch_size * train.grad_accum_steps
    if per_rank % grpo.num_generations:
        raise field_error("grpo.num_generations", f"{grpo.num_generations} completions per prompt do not divide the "
                                                  f"{per_rank} completions each rank trains per step "
                                                  f"(train.micro_batch_size x grad_accum_steps); make it a multiple")
    if grpo.max_new_tokens >= data.seq_len:
        raise field_error("grpo.max_new_tokens", f"{grpo.max_new_tokens} new tokens leave no room for the prompt in "
                                                 f"data.seq_len {data.seq_len}; raise seq_len or lower max_new_tokens")


def check_method_model(method: str, lora: Any, quantize: str | None = None) -> None:
    """A reward model is trained in full: its new head and the export as a sequence classifier have no LoRA form;
    a 4-bit base only where the method's row allows it."""
    facts = facts_of(method)
    if not facts.lora and lora is not None:
        raise field_error("model.lora", f"a {method} model is trained in full in this version; drop model.lora")
    if quantize is not None and facts.quantize is not None:
        raise field_error("model.quantize", f"{method} with a 4-bit base is not supported in this version "
                                            f"({facts.quantize}); drop model.quantize")


def check_method_data(method: str, data: Any) -> None:
    """The data section fits the method: pairs for dpo, orpo and reward, labelled answers for kto, token streams
    for sft; pairs are not packed (both answers of a pair go through the same micro-batch, one row each)."""
    facts = facts_of(method)
    wants = facts.data_shape
    if wants is None:
        if data.shape == "prompts":
            raise field_error("data.completion_field", "prompt_field and completion_field go together; set both (a "
                                                       "prompt alone is for train.method: grpo)")
        if data.shape in ("preference", "unpaired"):
            field = "chosen_field" if data.shape == "preference" else "label_field"
            raise field_error(f"data.{field}", f"{field} is for preference training, but train.method is sft; set "
                                               "train.method (dpo, orpo, kto or reward) or drop the field")
        return
    if facts.not_yet is not None:
        raise field_error("train.method", f"{method} is not supported in this version yet ({facts.not_yet}); "
                                          "use dpo or orpo")
    if wants == "prompts":
        if data.sources is not None:
            raise field_error("data.sources", "a data mixture is not supported for grpo yet; give data.path")
        _check_grpo_data(data)
        return
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
