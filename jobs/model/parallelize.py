"""The device mesh and FSDP2 wrapping (activation checkpointing, per-layer fully_shard, the embedding and the output
head as units of their own where asked, then the root)."""

from __future__ import annotations

import logging

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from ..dist import DistEnv
from .checkpointing import Checkpointing, wrap_blocks
from .scorehead import HEAD

log = logging.getLogger("fsdpjob.jobs.model")


def build_mesh(env: DistEnv, replicate_degree: int) -> DeviceMesh:
    """1-D ("shard",) mesh for full sharding, or 2-D ("replicate", "shard") for HSDP."""
    if replicate_degree < 1 or env.world_size % replicate_degree:
        raise ValueError(
            f"fsdp.replicate_degree ({replicate_degree}) must divide the number of workers ({env.world_size}): "
            f"{env.world_size} % {replicate_degree} = {env.world_size % max(replicate_degree, 1)}"
        )
    device_type = env.device.type
    if replicate_degree == 1:
        return init_device_mesh(device_type, (env.world_size,), mesh_dim_names=("shard",))
    shard = env.world_size // replicate_degree
    return init_device_mesh(device_type, (replicate_degree, shard), mesh_dim_names=("replicate", "shard"))


def apply_fsdp(
    model: nn.Module,
    *,
    mesh: DeviceMesh,
    layers: nn.ModuleList,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    reshard_after_forward: bool,
    activation_checkpointing: Checkpointing,
    cpu_offload: bool,
    compile_layers: bool | str = False,
    separate_root: bool = False,
    ignored_params: set[nn.Parameter] | None = None,
) -> None:
    """Shard ``model`` in place: each of ``layers`` is its own FSDP unit, the root holds the rest.

    ``model`` should be on the meta device so that no rank ever holds the full weights. ``compile_layers``: True
    compiles each block with inductor; a string names another dynamo backend (the CPU tests' "aot_eager": the same
    tracing and autograd graphs without inductor's minutes of C++ compilation on a small machine).
    ``separate_root``: the input embedding, and the final norm with the output head, as FSDP units of their own
    (root_units; spec fsdp.separate_root). ``ignored_params``: parameters FSDP2 leaves as they are (the 4-bit
    weights on one rank: jobs/model/quantize.py).
    """
    wrap_blocks(layers, activation_checkpointing)
    if compile_layers:
        # The torchtitan order (AC, then compile each block, then fully_shard), with the block's forward compiled
        # rather than the module: torch.compile(layer) would put an OptimizedModule (names "_orig_mod.") between
        # the model and its weights, and nn.Module.compile() compiles _call_impl, which runs the module's hooks:
        # FSDP2's all-gather and reshard hooks would be traced (or skipped with graph breaks) inside the frame.
        # With the instance's forward compiled, _call_impl stays eager: FSDP2's hooks run around the compiled
        # forward, state-dict names stay as they are, and one graph serves every block (the same code object;
        # tests/worker/test_model.py counts them). After the AC wrapper, so the recomputed region is compiled.
        # No fullgraph: a family whose block breaks the graph still trains (slower), not a crash at step 1.
        backend = compile_layers if isinstance(compile_layers, str) else "inductor"
        skip_side_effects = "skip_fwd_side_effects_in_bwd_under_checkpoint"
        if activation_checkpointing.any and hasattr(torch._dynamo.config, skip_side_effects):
            # transformers (5.x, with its `kernels` dependency) routes each block's kernels through a context
            # variable it sets and resets inside the block's forward. Dynamo refuses a side effect inside the
            # checkpointed region (eager AC would replay it in the backward) and runs the whole block eagerly,
            # graph break and all. Not replaying that set/reset pair in the recomputation changes nothing: it
            # routes calls, it computes nothing.
            torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True
        for layer in layers:
            layer.forward = torch.compile(layer.forward, backend=backend)
    mp_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    # Pinned memory needs an accelerator; on a CPU-only host it raises.
    offload = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if cpu_offload else OffloadPolicy()
    options = dict(mesh=mesh, mp_policy=mp_policy, offload_policy=offload, reshard_after_forward=reshard_after_forward,
                   ignored_params=ignored_params or None)
    for layer in layers:
        fully_shard(layer, **options)
    for unit, reshard in root_units(model) if separate_root else ():
        fully_shard(unit, **{**options, "reshard_after_forward": reshard and reshard_after_forward})
    # The root (embedding, final norm, lm_head) is the first unit the backward needs: resharding it after the
    # forward only to gather it again at once costs an all-gather per micro-batch (torch's advice: False for
    # the root; bench/RESULTS.md "After one collective per step, the root kept gathered ...").
    fully_shard(model, **{**options, "reshard_after_forward": False})


_FINAL_NORMS = ("norm", "ln_f", "final_layer_norm", "final_layernorm", "norm_f")  # llama & co, gpt2/falcon, neox


def _output_head(model: nn.Module) -> nn.Module | None:
    """The causal LM's lm_head, or the reward model's score head (jobs/model/scorehead.py)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return head if head is not None else getattr(model, HEAD, None)


def _final_norm(model: nn.Module) -> nn.Module | None:
    base = getattr(model, "base_model", model)
    for name in _FINAL_NORMS:
        norm = getattr(base, name, None)
        if isinstance(norm, nn.Module) and any(True for _ in norm.parameters()):
            return norm
    return None  # a family without one, or named otherwise: it stays with the root (a few KB)


def root_units(model: nn.Module) -> list[tuple[nn.Module | list[nn.Module], bool]]:
    """The units fsdp.separate_root shards apart from the root, each with whether it may reshard after forward:
    the input embedding (freed from its forward to its backward, which comes last) and the final norm with the
    output head, torchtitan's grouping (``norm`` + ``output``), kept gathered after forward because the backward
    starts with it. Apart from the root, both are gathered only around their own forward and backward, and the
    head's gradient is reduce-scattered as soon as its backward ends instead of at the very end of the step.

    None with tied embeddings: the embedding and lm_head are one parameter, which must live in one unit, and a
    unit of both would stay gathered from the first forward op to the last backward one, which is the root's
    behaviour already; so they stay with the root (logged). Same when the model has no recognisable embedding or
    head. Under LoRA the modules may be peft's wrappers (modules_to_save); they are sharded as they are."""
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    head = _output_head(model)
    if embedding is None or head is None:
        log.warning("fsdp.separate_root: %s has no input embedding or output head fsdpjob can find; they stay "
                    "with the root unit", type(model).__name__)
        return []
    if {id(p) for p in embedding.parameters()} & {id(p) for p in head.parameters()}:
        log.info("fsdp.separate_root: the embedding and the output head share their weight (tied embeddings); "
                 "they stay with the root unit, where they are gathered from forward into backward as before")
        return []
    norm = _final_norm(model)
    return [(embedding, True), ([norm, head] if norm is not None else head, False)]
