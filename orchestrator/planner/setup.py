"""The knobs of one plan: a spec resolved against its profile, as the memory and time models read it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

REDUCE_BYTES = 4  # fsdp.reduce_dtype's default: gradients reduce-scattered (and accumulated unsharded) in fp32


@dataclass(frozen=True)
class Setup:
    """The knobs of one plan (spec + profile resolved); fixes change these and plan again."""

    nodes: int
    tasks_per_node: int
    replicate_degree: int
    on_gpu: bool
    model_bytes: int  # m: master weights, gradients, AdamW moments
    compute_bytes: int  # c: gathered parameters and activations
    seq_len: int
    micro_batch: int
    grad_accum: int
    activation_checkpointing: bool  # full: every decoder layer recomputed in backward (selective_ac: the others)
    attn: str
    cpu_offload: bool
    reshard: bool  # reshard_after_forward, for the layers (the root stays gathered after forward either way)
    # With grad_accum > 1: micro-batches before the last skip the reduce-scatter and accumulate unsharded
    # fp32 gradients instead (less communication, more memory); make_plan turns it on where it fits.
    defer_grad_sync: bool = False
    lora: Any = None  # the spec's model.lora: only the adapters train (lora.py counts them); None: every weight
    quantize: str | None = None  # model.quantize: the frozen base's decoder linears in 4 bits (lora.NF4_BYTES)
    async_save: bool = False  # checkpoint.async_save: DCP's stager keeps a host copy of the saved state
    memory_tier: bool = False  # checkpoint.memory_interval_steps: snapshots in node-local shared memory
    packed: bool = False  # boundary-aware packing: with sdpa, transformers builds a dense block-diagonal mask
    onednn_bf16: bool = False  # CPU workers whose CPU runs bf16 matmuls in oneDNN (core/hostcpu.py)
    rows_per_example: int = 1  # preference pairs: both answers go through the forward, one row each
    reference_copy: bool = False  # dpo/kto reference: live on a full fine-tune: a frozen sharded copy of the model
    # The memory savers (issue 41; core/savers.py holds the rules the worker shares):
    selective_ac: str | int | None = None  # model.selective_ac with activation_checkpointing: selective; None: off
    chunked_loss: bool = False  # train.loss: chunked (core/savers.LOSS_CHUNK_TOKENS positions at a time)
    state_bytes: int = 0  # train.optimizer_state_dtype: bytes of each AdamW moment; 0: model_bytes
    reduce_bytes: int = REDUCE_BYTES  # fsdp.reduce_dtype: the reduce-scatter's input and accumulation dtype
    separate_root: bool = False  # fsdp.separate_root decided: embedding and norm + lm_head as their own units
    compile: bool = False  # model.compile: inductor's partitioner recomputes a block's elementwise outputs
    expandable_segments: bool = False  # PYTORCH_CUDA_ALLOC_CONF has expandable_segments:True (less slack)
    # grpo with the in-process generator: rows generated together per rank (a step's completions), 0: none
    generation_rows: int = 0
    generation_tokens: int = 0  # grpo.max_new_tokens
    generation_group: int = 0  # grpo.num_generations (a rank's completions per step are whole groups); 0: not grpo
    generator_nodes: int = 0  # nodes of the allocation grpo's generation server takes (nodes counts the trainers')

    @property
    def rows(self) -> int:
        """Rows of one micro-batch's forward."""
        return self.micro_batch * self.rows_per_example

    @property
    def dense_mask(self) -> bool:
        """sdpa on packed rows on GPUs: a [B, 1, S, S] bool mask per forward, which SDPA's memory-efficient kernel
        turns into a bias in the compute dtype per layer and keeps for backward (no flash kernel takes a mask);
        varlen attention needs none. On CPU the measured peaks show no such bias kept (tests/worker/
        test_plan_accuracy.py's S case on an AVX-512 CPU: 69-71 MiB against 73 planned without the term, 78 with
        it)."""
        return self.packed and self.attn == "sdpa" and self.on_gpu

    @property
    def moment_bytes(self) -> int:
        """Bytes of each AdamW moment (exp_avg, exp_avg_sq)."""
        return self.state_bytes or self.model_bytes

    @property
    def recompute(self) -> bool:
        """Some activations are recomputed in backward (full or selective activation checkpointing)."""
        return self.activation_checkpointing or self.selective_ac is not None

    @property
    def world(self) -> int:
        return self.nodes * self.tasks_per_node

    @property
    def shard_degree(self) -> int:
        return self.world // self.replicate_degree
