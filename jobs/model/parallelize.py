"""The device mesh and FSDP2 wrapping (activation checkpointing, per-layer then root fully_shard)."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from ..dist import DistEnv


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
    activation_checkpointing: bool,
    cpu_offload: bool,
    compile_layers: bool | str = False,
) -> None:
    """Shard ``model`` in place: each of ``layers`` is its own FSDP unit, the root holds the rest.

    ``model`` should be on the meta device so that no rank ever holds the full weights. ``compile_layers``: True
    compiles each block with inductor; a string names another dynamo backend (the CPU tests' "aot_eager": the same
    tracing and autograd graphs without inductor's minutes of C++ compilation on a small machine).
    """
    if activation_checkpointing:
        # Before fully_shard: FSDP must see the wrapper as the layer, so its hooks wrap the recomputation.
        for i, layer in enumerate(layers):
            layers[i] = checkpoint_wrapper(layer, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
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
        if activation_checkpointing and hasattr(torch._dynamo.config, "skip_fwd_side_effects_in_bwd_under_checkpoint"):
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
    options = dict(mesh=mesh, mp_policy=mp_policy, offload_policy=offload, reshard_after_forward=reshard_after_forward)
    for layer in layers:
        fully_shard(layer, **options)
    # The root (embedding, final norm, lm_head) is the first unit the backward needs: resharding it after the
    # forward only to gather it again at once costs an all-gather per micro-batch (torch's advice: False for
    # the root; bench/RESULTS.md "After one collective per step, the root kept gathered ...").
    fully_shard(model, **{**options, "reshard_after_forward": False})
