"""The planner's decisions about the memory savers that the spec leaves to it (train.loss: auto,
fsdp.separate_root: auto), and the savers it offers as fixes. The rules the worker shares are in core/savers.py;
the decisions reach the workers through the run's worker facts (fit.FitPlan.worker_facts: loss, separate_root).

- train.loss: auto is chunked where the logits (the loss's fp32 log-softmax and gradients at the end of the
  forward, or the logits held through the backward) are the largest item of the peak: at a 128K vocabulary and
  16K tokens per micro-batch they are 28 GiB, more than an 8B model's sharded state on 8 GPUs.
- fsdp.separate_root: auto is true where it lowers the planned peak: the root's gathered weights (and the
  lm_head's unsharded gradient) are no longer held through the layers' backward, for one more all-gather of the
  embedding and the lm_head per micro-batch.
With LoRA the root is frozen and tied embeddings are one unit (the worker keeps them with the root): auto keeps them
there. The chunked loss is the SFT step's (the preference methods refuse it). Both stay standard / false on CPU
workers: the CPU plan's accuracy is measured with them (bench/plan_accuracy.py).
"""

from __future__ import annotations

from dataclasses import replace

from fsdpjob.orchestrator.core.jobspec.methods import facts_of
from fsdpjob.orchestrator.core.jobspec.profiles import ClusterProfile
from fsdpjob.orchestrator.core.jobspec.spec import JobSpec

from .memory import DeviceMemory, device_memory
from .modelshape import ModelShape, ParamCount
from .setup import Setup

LOGITS_ITEMS = ("loss", "logits")


def expandable_segments(env: dict[str, str]) -> bool:
    """Whether PYTORCH_CUDA_ALLOC_CONF (the profile's env with the spec's over it) turns on expandable segments."""
    conf = env.get("PYTORCH_CUDA_ALLOC_CONF", "").replace(" ", "").lower()
    return "expandable_segments:true" in conf


def largest_item(dev: DeviceMemory) -> str:
    """The name of the largest item of the peak (state or transient; not the runtime or the slack)."""
    items = [i for i in (*dev.state, *dev.peak_moment.items) if i.bytes]
    return max(items, key=lambda i: i.bytes).name if items else ""


def logits_largest(s: ModelShape, p: ParamCount, u: Setup, profile: ClusterProfile) -> bool:
    return largest_item(device_memory(s, p, u, profile)) in LOGITS_ITEMS


def decide_savers(spec: JobSpec, s: ModelShape, p: ParamCount, u: Setup, profile: ClusterProfile) -> Setup:
    """``u`` with train.loss: auto and fsdp.separate_root: auto decided (GPU workers; CPU keeps the plain path)."""
    if not u.on_gpu:
        return u
    if spec.train.loss == "auto" and facts_of(spec.train.method).chunked_loss and logits_largest(s, p, u, profile):
        u = replace(u, chunked_loss=True)
    if spec.fsdp.separate_root == "auto" and u.lora is None and not s.tied:
        separate = replace(u, separate_root=True)
        if device_memory(s, p, separate, profile).peak < device_memory(s, p, u, profile).peak:
            u = separate
    return u


def saver_fixes(s: ModelShape, p: ParamCount, u: Setup, profile: ClusterProfile,
                method: str = "sft") -> list[tuple[str, Setup, str]]:
    """(change, setup, why) for each saver the plan does not use yet that would lower its peak, cheapest first."""
    out: list[tuple[str, Setup, str]] = []
    if not u.chunked_loss and facts_of(method).chunked_loss:  # other methods' losses read the logits themselves
        why = "the logits are the largest item" if logits_largest(s, p, u, profile) else "no full logits held"
        out.append(("train.loss=chunked", replace(u, chunked_loss=True),
                    f"{why}: the cross-entropy over chunks of the sequence, the same loss"))
    if not u.separate_root and u.lora is None and not s.tied:
        out.append(("fsdp.separate_root=true", replace(u, separate_root=True),
                    "the embedding and lm_head freed between forward and backward: one more all-gather of each"))
    if not u.activation_checkpointing and u.selective_ac is None:
        out.append(("model.activation_checkpointing=selective", replace(u, selective_ac="op"),
                    "keep the matmul outputs, recompute the elementwise rest: between none and full, a few % slower"))
    return out
