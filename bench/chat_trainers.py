"""TRL's SFTTrainer and HF Trainer on a chat JSONL, on FSDP2: the baselines of bench/chat_throughput.py (torchrun).

    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 bench/chat_trainers.py --case trl-packing --model DIR \
        --data chat.jsonl --seq-len 512 --micro-batch 2 --steps 20 --out times.json [--force-fsdp2]

Cases (per-device batch ``--micro-batch``: packed rows of ``--seq-len`` for trl-packing, examples otherwise):

- ``trl-packing``: ``SFTConfig(packing=True, max_length=seq_len)`` (its default strategy, best-fit decreasing;
  TRL then runs padding-free: a micro-batch's rows go to the model flattened into one row with ``position_ids``);
- ``trl-padding-free``: ``SFTConfig(padding_free=True, max_length=None)`` without packing (TRL refuses a max_length
  there; the examples are already at most seq_len long): the micro-batch's examples flattened into one row;
- ``hf-padding``: ``Trainer`` on the examples tokenized with the tokenizer's chat template, padded to the longest of
  each micro-batch by ``DataCollatorForLanguageModeling(mlm=False)`` (labels -100 at the padding).

TRL reads the messages and tokenizes them itself (before the first step); both TRL cases train on every token
(TRL's default for conversations; assistant_only_loss needs {% generation %} markers the template lacks), as the HF
case does: the loss mask costs no compute. Everything else is bench/hf_trainer.py's: the same TrainingArguments
(FSDP2 forced on with ``--force-fsdp2``, fp32, AdamW, constant LR, clip 1.0), sdpa attention, the default
(seeded, shuffled) sampler. Rank 0 writes ``--out``: every step's end time, the logged losses, what ran, and
``real_tokens``: each step's non-pad input positions summed over the ranks (counted in training_step, from the
batch the model gets: its attention mask where it has one, else all its positions), and ``positions``: all of them.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from hf_trainer import clock, finish, forcing_fsdp2, trainer_arguments, what_ran

CASES = ("trl-packing", "trl-padding-free", "hf-padding")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", choices=CASES, required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--data", required=True, help="JSONL of {messages: [{role, content}, ...]}")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--micro-batch", type=int, default=2, help="per device: packed rows or examples")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--force-fsdp2", action="store_true")
    parser.add_argument("--out", type=Path)
    return parser.parse_args(argv)


def real_tokens(inputs) -> tuple[int, int]:
    """Non-pad positions of a batch as the model gets it (padded batches carry an attention mask, padding-free ones,
    TRL's flattened rows, none and no padding), and all its positions."""
    mask, positions = inputs.get("attention_mask"), int(inputs["input_ids"].numel())
    return (int(mask.sum()) if mask is not None else positions), positions


def counting(base: type, counts: list[tuple[int, int]]) -> type:
    class Counting(base):
        def training_step(self, model, inputs, *rest, **kw):
            counts.append(real_tokens(inputs))
            return super().training_step(model, inputs, *rest, **kw)

    return Counting


def build(args, model, tokenizer, workdir: str, counts: list[tuple[int, int]], callbacks: list):
    """The case's trainer, FSDP2 forced on as asked."""
    from datasets import Dataset, load_dataset

    records = load_dataset("json", data_files=args.data, split="train")
    common = trainer_arguments(args, type(model.model.layers[0]).__name__, workdir)
    if args.case.startswith("trl"):
        from trl import SFTConfig, SFTTrainer

        shape = {"packing": True, "max_length": args.seq_len} if args.case == "trl-packing" else \
            {"padding_free": True, "max_length": None}  # fmt: skip
        config = SFTConfig(**common, **shape, dataset_num_proc=None)
        trainer_class = counting(forcing_fsdp2(SFTTrainer, args.force_fsdp2), counts)
        return trainer_class(model=model, args=config, train_dataset=records, processing_class=tokenizer,
                             callbacks=callbacks)  # fmt: skip
    from transformers import DataCollatorForLanguageModeling, Trainer, TrainingArguments

    ids = [tokenizer.apply_chat_template(r["messages"], tokenize=True, return_dict=True)["input_ids"]
           for r in records]  # fmt: skip
    dataset = Dataset.from_dict({"input_ids": ids})
    trainer_class = counting(forcing_fsdp2(Trainer, args.force_fsdp2), counts)
    collator = DataCollatorForLanguageModeling(tokenizer, mlm=False)
    return trainer_class(model=model, args=TrainingArguments(**common), train_dataset=dataset, data_collator=collator,
                         callbacks=callbacks)  # fmt: skip


def main() -> None:
    args = parse_args()
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, attn_implementation="sdpa")
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    record: dict = {"times": [], "losses": []}
    counts: list[tuple[int, int]] = []
    trainer = build(args, model, tokenizer, tempfile.mkdtemp(prefix="chat-trainer-"), counts,
                    [clock(record, lambda: {**what_ran(trainer, args.force_fsdp2), "case": args.case})])  # fmt: skip
    trainer.train()
    summed = torch.tensor(counts[: args.steps], dtype=torch.float64)
    dist.all_reduce(summed)  # every rank ran the same number of steps
    record["real_tokens"], record["positions"] = (column.tolist() for column in summed.long().T)
    finish(record, args.out)


if __name__ == "__main__":
    main()
