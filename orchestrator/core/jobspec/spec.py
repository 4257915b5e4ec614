"""The job spec: strict pydantic models (the public contract of a YAML job file) and its loader."""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, ValidationError, ValidationInfo, field_validator, model_validator

from .container import ContainerSpec
from .dataspec import DataSpec
from .loggingspec import LoggingSpec
from .methods import (
    METHODS,
    DpoSpec,
    GrpoSpec,
    KtoSpec,
    Method,
    OrpoSpec,
    RewardSpec,
    check_grpo,
    check_method_data,
    check_method_model,
    check_method_sections,
    facts_of,
    method_options,
    with_method_fields,
)
from .modelspec import Dtype, LoraSpec, ModelSpec, ShortDtype  # noqa: F401  (LoraSpec: imported from here too)
from .notifyspec import NotifySpec
from .resources import Resources
from .validation import (
    PATH_MAX_BYTES,
    SpecErrors,
    Strict,
    check_env,
    errors_from_validation,
    field_error,
    path_value,
)
from .yamlio import YamlDoc, apply_overrides, read_yaml

PositiveInt = Annotated[int, Field(strict=True, gt=0)]
NonNegativeInt = Annotated[int, Field(strict=True, ge=0)]

# Environment variable names whose values are treated as secret unless the spec says otherwise.
SECRET_NAME_PATTERN = re.compile(r"TOKEN|KEY|SECRET|PASSWORD", re.IGNORECASE)


class TrainSpec(Strict):
    max_steps: PositiveInt
    """Optimizer steps to run in total (across restarts)."""
    micro_batch_size: PositiveInt = 1
    """Sequences per worker per forward pass."""
    grad_accum_steps: PositiveInt = 1
    """Micro-batches accumulated per optimizer step."""
    lr: Annotated[float, Field(strict=True, gt=0)] = 2e-5
    """Peak learning rate."""
    lr_schedule: Literal["cosine", "linear", "constant"] = "cosine"
    """Decay after warmup."""
    warmup_steps: NonNegativeInt = 0
    """Linear warmup steps from 0 to lr."""
    min_lr_ratio: Annotated[float, Field(strict=True, ge=0, le=1)] = 0.0
    """Floor of the decay as a fraction of lr (cosine and linear)."""
    weight_decay: Annotated[float, Field(strict=True, ge=0)] = 0.0
    """AdamW weight decay."""
    betas: tuple[Annotated[float, Field(strict=True, ge=0, lt=1)],
                 Annotated[float, Field(strict=True, ge=0, lt=1)]] = (0.9, 0.95)
    """AdamW betas."""
    max_grad_norm: Annotated[float, Field(strict=True, ge=0)] = 1.0
    """Clip the global gradient norm to this; 0 disables clipping."""
    seed: Annotated[int, Field(strict=True)] = 0
    """Seed for data order and random state."""
    log_every: PositiveInt = 10
    """Log metrics every this many steps."""
    eval_every: NonNegativeInt = 0
    """Evaluate on the eval data (data.eval_path or data.eval_fraction) every this many steps and at the end; 0: off."""
    eval_batches: NonNegativeInt = 0
    """Micro-batches per worker per evaluation; 0: the whole eval set."""
    loss: Literal["auto", "standard", "chunked"] = "auto"
    ("standard: the cross-entropy over the full logits in fp32. chunked: over chunks of the sequence, never holding "
     "the whole sequence's logits in fp32 (the same loss; far less memory at a large vocabulary). auto: chunked where "
     "the plan finds the logits the largest item of a step's memory.")
    optimizer_state_dtype: Dtype = "float32"
    """Dtype of AdamW's two moment states (bfloat16 halves their memory; the master weights stay model.dtype)."""
    method: Method = "sft"
    ("sft: supervised fine-tuning. dpo, orpo, kto: preference training; reward: a reward model; grpo: reinforcement "
     "learning with verifiable rewards. Each reads its own section (dpo:, orpo:, kto:, reward:, grpo:), which may be "
     "left out for its defaults (grpo: needs its reward functions).")

    @field_validator("betas", mode="before")
    @classmethod
    def _two_betas(cls, value: Any) -> Any:
        if isinstance(value, (list, tuple)) and len(value) != 2:
            raise ValueError(f"betas takes two numbers (beta1, beta2), e.g. [0.9, 0.95]; got {len(value)}")
        return value

    @model_validator(mode="after")
    def _warmup(self) -> TrainSpec:
        if self.warmup_steps >= self.max_steps:
            raise ValueError(f"warmup_steps ({self.warmup_steps}) must be below max_steps ({self.max_steps})")
        if self.eval_batches and not self.eval_every:
            raise field_error("eval_batches",
                              "eval_batches needs eval_every; set train.eval_every or drop eval_batches")
        return self

    @model_validator(mode="after")
    def _chunked_for_sft(self) -> TrainSpec:
        if self.loss == "chunked" and not facts_of(self.method).chunked_loss:
            raise field_error("loss", f"the chunked loss is SFT's cross-entropy; {self.method} computes its own "
                                      "loss from the model's outputs; set train.loss: auto or standard")
        return self


class FsdpSpec(Strict):
    reshard_after_forward: bool = True
    """Free gathered parameters after forward (less memory, one more all-gather in backward)."""
    mixed_precision: ShortDtype = "bf16"
    """Compute dtype: bf16 or fp32 (bfloat16 and float32 are read as these)."""
    reduce_dtype: Dtype = "float32"
    """Dtype of the gradients' reduce-scatter (bfloat16 halves its traffic and buffers, at some precision)."""
    separate_root: Literal["auto"] | bool = "auto"
    ("Shard the embedding and the final norm with lm_head as FSDP units of their own, freed between forward and "
     "backward, instead of with the root module (held gathered from forward into backward); auto: where the plan "
     "finds it lowers the peak.")
    cpu_offload: bool = False
    """Keep sharded parameters, gradients and optimizer state in host memory."""
    replicate_degree: PositiveInt = 1
    """HSDP: replicate across this many groups, shard within each (1 = full sharding)."""
    collective_timeout_s: PositiveInt = 600
    """Timeout of process-group setup and collectives; a dead peer fails the job after this."""


class CheckpointSpec(Strict):
    dir: str | None = None
    """Checkpoint folder. Default: checkpoints/ inside the run folder."""
    interval_steps: NonNegativeInt = 0
    """Save every this many steps (0: off)."""
    interval_minutes: Annotated[float, Field(strict=True, ge=0)] = 30.0
    """Save when this many minutes passed since the last save (0: off)."""
    keep_last: PositiveInt = 2
    """Committed checkpoints to keep; the newest is never removed."""
    async_save: bool = False
    """Write checkpoints in the background (dcp.async_save on its own process group)."""
    export_final: bool = False
    """At the end of the job, export a Hugging Face folder (safetensors) to <run>/export."""
    keep_best: bool = False
    """Also keep the committed checkpoint with the lowest eval loss (needs train.eval_every)."""
    memory_interval_steps: Literal["auto"] | NonNegativeInt = 0
    ("Every this many steps, also snapshot every rank's shards into node-local shared memory (/dev/shm/fsdpjob, or "
     "$FSDPJOB_MEMORY_TIER_DIR), with a replica on another node: a restart in the same allocation resumes from there "
     "(0: off). auto: snapshots 5 and 10 steps into each launch, then as often as Young/Daly says for the second's "
     "measured stall (the first pays a one-time staging allocation) and the profile's expected_interruptions_per_day, "
     "never more than a 5% stall.")

    _dir = field_validator("dir")(path_value)


class PreemptionSpec(Strict):
    signal: Literal["USR1", "USR2", "TERM", "INT", "HUP", "URG"] = "USR2"
    """Signal Slurm sends to the workers before preemption or the time limit."""
    signal_lead_s: Literal["auto"] | PositiveInt = "auto"
    """Seconds before the end at which the signal comes; auto: 120 s, or a tenth of a short time limit."""
    max_requeues: NonNegativeInt = 20
    """Requeues allowed (preemption, time limit, node failure) before the job is failed."""


class RecoverySpec(Strict):
    max_restarts: NonNegativeInt = 3
    ("Restarts inside one allocation after a crash or a hang (a new srun step; no requeue). 0: off, every crash goes "
     "through the queue.")
    stall_floor_s: PositiveInt = 30
    """A training run counts as hung when no rank advanced for max(stall_factor x its recent p95 step time, this)."""
    stall_factor: Annotated[float, Field(strict=True, ge=2)] = 10.0
    """How many p95 step times (or previous save/eval times) without progress make a stall."""
    setup_timeout_s: Literal["auto"] | PositiveInt = "auto"
    ("Bound on the setup (launch to first step); auto: 3x the previous attempt's setup + 60 s (on a first start "
     "900 s + 3x the plan's set-up work: the weights read at the profile's storage bandwidth and the data "
     "tokenized at a measured rate), and until every rank has started, 3x the longest launch in this allocation "
     "+ 60 s, at least 900 s on an allocation's first launch (a container image may be imported on new nodes). "
     "A number bounds both.")


# Fields added after specs were already hashed (see JobSpec.spec_hash).
_ADDED_FIELDS = {"data": ("eval_path", "eval_fraction", "format", "split", "sources", "eval_split", "long_examples",
                          "chosen_field", "rejected_field", "label_field"),
                 "train": ("eval_every", "eval_batches", "method", "loss", "optimizer_state_dtype"),
                 "checkpoint": ("keep_best", "memory_interval_steps"),
                 "model": ("lora", "compile", "selective_ac", "quantize"),
                 "resources": ("min_nodes",), "fsdp": ("reduce_dtype", "separate_root")}
_ADDED_SECTIONS = ("recovery", "logging")  # whole sections added later: count only when not all defaults
# Defaults that changed name: a spec that leaves the field alone hashes as it did under the old default's value.
_RENAMED_DEFAULTS = {("model", "attn_implementation"): ("auto", "sdpa")}
# Values that were written another way when specs were already hashed (a bool before the selective option).
_RENAMED_VALUES = {("model", "activation_checkpointing"): {"none": False, "full": True}}


class JobSpec(Strict):
    name: str
    """Run name: letters, digits, '.', '_' and '-' (starts with a letter or digit)."""
    profile: str = "local"
    """Cluster profile: a name from `fsdpjob profiles` or a path to a profile YAML."""
    env: dict[str, str] = {}
    """Extra environment variables for the workers. Values may use $VAR and ${VAR}; nothing else is expanded."""
    secret_env: list[str] = []
    ("Names in env whose values are secret (besides names containing TOKEN, KEY, SECRET or PASSWORD): passed to the "
     "job, never written to disk.")
    resources: Resources = Field(default_factory=Resources)
    model: ModelSpec
    data: DataSpec
    train: TrainSpec
    fsdp: FsdpSpec = Field(default_factory=FsdpSpec)
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec)
    preemption: PreemptionSpec = Field(default_factory=PreemptionSpec)
    recovery: RecoverySpec = Field(default_factory=RecoverySpec)
    logging: LoggingSpec = Field(default_factory=LoggingSpec)
    container: ContainerSpec | None = None
    """Run the workers in a container: overrides fields of the profile's container (mounts and env add to it)."""
    notify: NotifySpec | None = None
    """Tell about the run's events by Slurm's mail and/or a webhook: overrides fields of the profile's notify."""
    dpo: DpoSpec | None = None
    """DPO's options (train.method: dpo)."""
    orpo: OrpoSpec | None = None
    """ORPO's options (train.method: orpo)."""
    kto: KtoSpec | None = None
    """KTO's options (train.method: kto)."""
    reward: RewardSpec | None = None
    """The reward model's options (train.method: reward)."""
    grpo: GrpoSpec | None = None
    """GRPO's options (train.method: grpo): its reward functions, generation and loss."""

    @field_validator("name")
    @classmethod
    def _slug(cls, value: str) -> str:
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}", value):
            raise ValueError(f"{value!r} is not a valid name; use up to 64 letters, digits, '.', '_' or '-'")
        return value

    @model_validator(mode="after")
    def _eval_settings(self) -> JobSpec:
        """Evaluation takes eval data and train.eval_every together; keep_best needs evaluations."""
        if self.train.eval_every and not self.data.has_eval:
            raise field_error("train.eval_every", "evaluation needs eval data; set data.eval_path or "
                                                  "data.eval_fraction, or set eval_every to 0")
        if self.data.has_eval and not self.train.eval_every:
            which = "eval_path" if self.data.eval_path is not None else "eval_fraction"
            raise field_error(f"data.{which}", "eval data is given but evaluation is off; set train.eval_every "
                                               f"(steps) or drop data.{which}")
        if self.checkpoint.keep_best and not self.train.eval_every:
            raise field_error("checkpoint.keep_best", "keep_best needs evaluations; set train.eval_every (and eval "
                                                      "data) or drop keep_best")
        return self

    @model_validator(mode="before")
    @classmethod
    def _method_fields(cls, raw: Any) -> Any:
        return with_method_fields(raw)

    @model_validator(mode="after")
    def _method_section(self) -> JobSpec:
        check_method_sections(self.train.method, self._method_sections())
        check_method_data(self.train.method, self.data)
        check_method_model(self.train.method, self.model.lora, self.model.quantize)
        check_grpo(self.grpo, self.train, self.data)
        return self

    def _method_sections(self) -> dict:
        """Each method's section as written (None where left out), by the table's method names."""
        return {name: getattr(self, name) for name, facts in METHODS.items() if facts.section is not None}

    @property
    def method_options(self) -> DpoSpec | OrpoSpec | KtoSpec | RewardSpec | GrpoSpec | None:
        """The options of train.method (its section or its defaults); None for sft."""
        return method_options(self.train.method, self._method_sections())

    @model_validator(mode="after")
    def _gpu_combinations(self) -> JobSpec:
        """Combinations that fail on GPUs only, refused before they reach one."""
        if self.model.attn_implementation in ("flash_attention_2", "varlen") and self.fsdp.mixed_precision != "bf16":
            raise field_error("model.attn_implementation", f"{self.model.attn_implementation} computes in bf16/fp16 "
                                                           "only on GPUs and errors at the first forward with fp32 "
                                                           "q/k/v; set fsdp.mixed_precision: bf16 or "
                                                           "attn_implementation: auto")
        if self.model.attn_implementation == "varlen" and not (facts_of(self.train.method).packs
                                                               and self.data.packing is True):
            # The kernel takes each row's examples from the boundaries that boundary-aware packing records
            # (positions restarting at 0); rows of pairs, answers or prompts, padded rows and naive packing give
            # none it can use, and the first forward raises after the whole model load.
            why = (f"train.method {self.train.method} does not pack its rows" if not facts_of(self.train.method).packs
                   else f"data.packing is {self.data.packing!r}")
            raise field_error("model.attn_implementation", f"varlen attention runs on boundary-aware packing only "
                                                           f"(data.packing: true), and {why}; set attn_implementation: "
                                                           "auto (it picks varlen where it applies) or sdpa")
        if self.fsdp.replicate_degree > 1 and self.fsdp.cpu_offload:
            # DeviceMesh's dimension groups may be NCCL-only (torch-version dependent): the offloaded CPU gradients'
            # clip-norm reduction would find no CPU backend. Untested on GPUs, so refused.
            raise field_error("fsdp.cpu_offload", "CPU offload with HSDP (replicate_degree > 1) is not supported: "
                                                  "set replicate_degree: 1 or cpu_offload: false")
        if self.fsdp.replicate_degree > 1 and self.model.quantize is not None:
            # torchao's NF4 all-gather reads the group of a 1-D mesh; HSDP's mesh has two dimensions.
            raise field_error("model.quantize", "quantize nf4 shards on a 1-D mesh only: set fsdp.replicate_degree: "
                                                "1 or drop model.quantize")
        return self

    @field_validator("env")
    @classmethod
    def _env_names(cls, value: dict[str, str]) -> dict[str, str]:
        return check_env(value)

    @field_validator("secret_env")
    @classmethod
    def _secrets_known(cls, value: list[str], info: ValidationInfo) -> list[str]:
        env = info.data.get("env")
        unknown = [n for n in value if env is not None and n not in env]
        if unknown:
            raise ValueError(f"names {unknown} are not in env; list only names that env sets")
        return value

    def secret_names(self) -> set[str]:
        return {k for k in self.env if k in self.secret_env or SECRET_NAME_PATTERN.search(k)}

    def public_env(self) -> dict[str, str]:
        secret = self.secret_names()
        return {k: v for k, v in self.env.items() if k not in secret}

    def redacted(self) -> JobSpec:
        """A copy safe to write to disk: secret env values replaced by a marker."""
        secret = self.secret_names()
        env = {k: ("<secret>" if k in secret else v) for k, v in self.env.items()}
        return self.model_copy(update={"env": env})

    def spec_hash(self) -> str:
        """Stable hash of the redacted, resolved spec. Fields added later count only when set to something other
        than their default, so a spec that does not use them keeps the hash it had before they existed."""
        dumped = self.redacted().model_dump(mode="json")
        for section, keys in _ADDED_FIELDS.items():
            fields = type(getattr(self, section)).model_fields
            for key in keys:
                if getattr(getattr(self, section), key) == fields[key].default:
                    del dumped[section][key]
        for (section, key), (now, before) in _RENAMED_DEFAULTS.items():
            if dumped[section][key] == now:
                dumped[section][key] = before
        for (section, key), renames in _RENAMED_VALUES.items():
            dumped[section][key] = renames.get(dumped[section][key], dumped[section][key])
        if self.model.lora is not None and self.model.lora.target_modules == "auto":
            # auto became the default (issue 56): it is all-linear on every family LoRA trained before it
            dumped["model"]["lora"]["target_modules"] = "all-linear"
        for section in _ADDED_SECTIONS:
            if getattr(self, section) == type(self).model_fields[section].default_factory():
                del dumped[section]
        if self.container is None:
            del dumped["container"]  # added later: a spec without one keeps its hash
        for later in ("notify", *self._method_sections()):  # added later too (each method's section), likewise
            if getattr(self, later) is None:
                del dumped[later]
        blob = json.dumps(dumped, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def model_fingerprint(self) -> dict[str, Any]:
        """Fields that define the model's shape and training math: a resume must not change these."""
        return {
            "model.path": self.model.path,
            "model.dtype": self.model.dtype,
            "data.seq_len": self.data.seq_len,
            # Adapters of another shape or scale cannot continue; absent without LoRA, as before it existed.
            **({"model.lora": self.model.lora.model_dump(mode="json")} if self.model.lora else {}),
            # A 4-bit base is another model for the adapters; absent without it, as before it existed.
            **({"model.quantize": self.model.quantize} if self.model.quantize else {}),
        }



# ----------------------------------------------------------------------------------------------
# Loading: YAML text -> overrides -> pydantic -> one-line errors that point at FILE:LINE (validation.py).



def _resolve_paths(data: dict, base: Path) -> dict:
    """Make model.path, data.path, data.eval_path, each data.sources path, checkpoint.dir and each grpo reward
    function's file absolute, relative to the spec file's folder (a glob too: its pattern part stays as it is)."""
    places = [(data.get(section), key) for section, key in
              (("model", "path"), ("data", "path"), ("data", "eval_path"), ("checkpoint", "dir"))]
    sources = data["data"].get("sources") if isinstance(data.get("data"), dict) else None
    places += [(source, "path") for source in sources] if isinstance(sources, list) else []
    grpo = data.get("grpo")
    rewards = grpo.get("reward") if isinstance(grpo, dict) else None
    rewards = [rewards] if isinstance(rewards, (str, dict)) else rewards
    if isinstance(rewards, list):  # each file.py:function's file (a module:function stays as it is)
        grpo["reward"] = [_resolve_function(r, base) for r in rewards]
    for sec, key in places:
        # A NUL cannot be resolved, and an over-long path would cost a file system lookup per part (a 250 KB
        # one took 30 s): leave both for the field validator to report.
        if (isinstance(sec, dict) and isinstance(sec.get(key), str) and sec[key] and "\x00" not in sec[key]
                and len(sec[key]) <= PATH_MAX_BYTES):
            p = Path(os.path.expanduser(sec[key]))  # unlike Path.expanduser, leaves an unknown ~user as it is
            sec[key] = str(p if p.is_absolute() else (base / p).resolve())
    return data


def _resolve_function(reward: Any, base: Path) -> Any:
    item = {"function": reward} if isinstance(reward, str) else reward
    function = item.get("function") if isinstance(item, dict) else None
    if not isinstance(function, str) or ".py:" not in function or "\x00" in function:
        return reward
    where, name = function.rsplit(":", 1)
    p = Path(os.path.expanduser(where))
    return {**item, "function": f"{p if p.is_absolute() else (base / p).resolve()}:{name}"}


def spec_from_doc(doc: YamlDoc, overrides: list[str] = (), base_dir: Path | None = None) -> JobSpec:
    data = apply_overrides(doc.data, list(overrides))
    if base_dir is not None:
        data = _resolve_paths(data, base_dir)
    try:
        return JobSpec.model_validate(data)
    except ValidationError as exc:
        raise SpecErrors(errors_from_validation(exc, doc, JobSpec, data=data)) from None


def load_spec(path: str | Path, overrides: list[str] = ()) -> tuple[JobSpec, YamlDoc]:
    """Read, override and validate a spec file. Paths inside become absolute."""
    doc = read_yaml(path).with_overrides(list(overrides))
    return spec_from_doc(doc, overrides, base_dir=Path(path).resolve().parent), doc


def json_schema() -> dict:
    from .fielddocs import documented

    schema = documented(JobSpec).model_json_schema()
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "fsdpjob job spec"
    return schema
