"""Hugging Face Trainer + accelerate with FSDP2 asked for, the third side of bench/worker_throughput.py.

    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 bench/hf_trainer.py --model DIR --data FILE.jsonl \
        [--seq-len 128] [--micro-batch 4] [--steps 20] [--activation-checkpointing] [--out times.json] \
        [--force-fsdp2]

Needs the ``bench`` extra (``pip install -e '.[bench]'``: accelerate). The Trainer is configured the
documented way: ``TrainingArguments(use_cpu=True, fsdp="full_shard auto_wrap", fsdp_config={"version": 2,
"transformer_layer_cls_to_wrap": [<decoder layer class>], "reshard_after_forward": True})``, fp32, AdamW
(betas 0.9/0.95, no weight decay, constant LR), ``max_grad_norm=1.0``, per-device batch ``--micro-batch``,
no gradient accumulation, no saving, no reporting, logging at step 1 and the last step;
``--activation-checkpointing`` sets ``gradient_checkpointing=True``. The same packed rows as
bench/bare_fsdp2.py in the same order (a sequential sampler; accelerate gives rank r batch 2k+r of step k).

On a CPU host accelerate's state is MULTI_CPU, and it only honours an FSDP plugin for accelerator
device types: the Trainer then silently wraps the model in DDP. Rank 0 records what really ran
(accelerate's distributed type, the wrapped model's class, how many parameters are DTensors) in
``--out``. ``--force-fsdp2`` sets accelerate's shared state to FSDP with the Trainer's own FSDP2 plugin
before the Trainer prepares the model, so that FSDP2 does run on the CPU (not a documented setting).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bare_fsdp2 import packed_rows, parse_args


def trainer_arguments(args, layer_class: str, workdir: str, **extra) -> dict:
    """The TrainingArguments keywords of every HF case (bench/chat_trainers.py too): FSDP2 configured as documented,
    fp32, AdamW (betas 0.9/0.95, no weight decay, constant LR), clip 1.0, no gradient accumulation, no saving, no
    reporting, logging at step 1 and the last step; ``extra`` adds or replaces keywords."""
    return {
        "output_dir": workdir, "use_cpu": True, "ddp_backend": "gloo", "seed": 0,
        "per_device_train_batch_size": args.micro_batch, "gradient_accumulation_steps": 1, "max_steps": args.steps,
        "learning_rate": args.lr, "lr_scheduler_type": "constant", "warmup_steps": 0, "adam_beta1": 0.9,
        "adam_beta2": 0.95, "weight_decay": 0.0, "max_grad_norm": 1.0, "optim": "adamw_torch",
        "fsdp": "full_shard auto_wrap",
        "fsdp_config": {"version": 2, "transformer_layer_cls_to_wrap": [layer_class], "reshard_after_forward": True},
        "gradient_checkpointing": getattr(args, "activation_checkpointing", False),
        "save_strategy": "no", "report_to": [], "logging_strategy": "steps", "logging_steps": args.steps,
        "logging_first_step": True, "disable_tqdm": True, "dataloader_num_workers": 0, "dataloader_drop_last": True,
        **extra,
    }  # fmt: skip


def forcing_fsdp2(base: type, force: bool) -> type:
    """``base`` (a Trainer class) that, with ``force``, sets accelerate's shared state to FSDP with the Trainer's own
    FSDP2 plugin before the Trainer prepares the model (a CPU host would otherwise run DDP)."""

    class Forced(base):
        def create_accelerator_and_postprocess(self) -> None:
            super().create_accelerator_and_postprocess()
            if force:
                from accelerate.state import PartialState
                from accelerate.utils import DistributedType

                state = self.accelerator.state
                # Both shared states: every AcceleratorState() copies PartialState's over its own (as
                # accelerate's own FSDP set-up does on GPUs).
                state.distributed_type = PartialState._shared_state["distributed_type"] = DistributedType.FSDP
                state.fsdp_plugin = getattr(state, "fsdp_plugin", None) or _plugin(self.args)
                self.is_fsdp_enabled = True

    return Forced


def clock(record: dict, describe):
    """A callback that appends the train start and every step end (wall time) to record["times"], the logged losses
    to record["losses"], and ``describe()`` to record["info"] after step 1."""
    from transformers import TrainerCallback

    class Clock(TrainerCallback):
        def on_train_begin(self, *unused, **kw):
            record["times"].append(time.time())

        def on_step_end(self, *unused, **kw):
            record["times"].append(time.time())
            if len(record["times"]) == 2:
                record["info"] = describe()

        def on_log(self, _args, state, _control, logs=None, **kw):
            if logs and "loss" in logs:
                record["losses"].append([state.global_step, logs["loss"]])

    return Clock()


def what_ran(trainer, force: bool) -> dict:
    """accelerate's view and the wrapped model: whether FSDP2 really ran (rank 0, after step 1)."""
    import torch
    from torch.distributed.tensor import DTensor

    wrapped, inner = trainer.model_wrapped, trainer.model
    params = list(inner.parameters())
    return {
        "accelerate_distributed_type": str(trainer.accelerator.distributed_type),
        "fsdp_version": getattr(getattr(trainer.accelerator.state, "fsdp_plugin", None), "fsdp_version", None),
        "wrapped_model_type": type(wrapped).__name__,
        "model_type": type(inner).__name__,
        "dtensor_params": sum(isinstance(p, DTensor) for p in params),
        "param_tensors": len(params),
        "layer_type": type(inner.model.layers[0]).__name__,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "gradient_checkpointing": bool(getattr(inner, "is_gradient_checkpointing", False)),
        "forced": force,
    }


def finish(record: dict, out: Path | None) -> None:
    """Rank 0 writes the record; then every rank leaves gloo together."""
    import torch.distributed as dist

    if dist.get_rank() == 0 and out:
        out.write_text(json.dumps(record))
    dist.barrier()  # no rank tears gloo down while another still talks to it
    dist.destroy_process_group()


def main() -> None:
    parser_args = sys.argv[1:]
    force = "--force-fsdp2" in parser_args
    args = parse_args([a for a in parser_args if a != "--force-fsdp2"])
    import tempfile

    import torch
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, attn_implementation="sdpa")
    layer_class = type(model.model.layers[0]).__name__
    training_args = TrainingArguments(**trainer_arguments(args, layer_class, tempfile.mkdtemp(prefix="hf-trainer-")))
    world = training_args.world_size
    rows = packed_rows(args.model, args.data, args.seq_len, args.micro_batch * world * args.steps)
    dataset = [{"input_ids": row, "labels": row} for row in rows]

    class InOrder(forcing_fsdp2(Trainer, force)):
        def _get_train_sampler(self, *unused, **unused_kw):
            return torch.utils.data.SequentialSampler(self.train_dataset)

    record: dict = {"times": [], "losses": []}
    trainer = InOrder(model=model, args=training_args, train_dataset=dataset,
                      callbacks=[clock(record, lambda: what_ran(trainer, force))])  # fmt: skip
    trainer.train()
    record["tokens_per_step"] = args.micro_batch * world * args.seq_len
    finish(record, args.out)


def _plugin(training_args):
    from accelerate.utils import FullyShardedDataParallelPlugin

    return FullyShardedDataParallelPlugin(**training_args.fsdp_plugin_args)


if __name__ == "__main__":
    main()
