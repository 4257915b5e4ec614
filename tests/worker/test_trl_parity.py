"""fsdpjob's preference losses against TRL 1.16's own trainers on a real forward of the quickstart's tiny Llama,
on the same token ids from the raw records: ORPO's total loss, its gradient and every metric TRL logs (TRL's
ORPOTrainer.get_batch_loss_metrics, called unbound on a stand-in trainer, its forward and all)."""

from __future__ import annotations

import copy
import json
import random
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("trl")
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def quickstart(tmp_path_factory) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fsdpjob.jobs.quickstart import make_quickstart

    folder = tmp_path_factory.mktemp("quickstart")
    made = make_quickstart(folder)
    rng = random.Random(3)
    lines = []
    for _ in range(6):
        a, b = rng.randrange(100, 1000), rng.randrange(10, 1000)
        lines.append(json.dumps({"prompt": f"{a}+{b}=", "chosen": str(a + b), "rejected": str(a + b + 7)[::-1]}))
    pairs = folder / "pairs.jsonl"
    pairs.write_text("\n".join(lines) + "\n")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(made["model_path"], dtype=torch.float32)
    with torch.no_grad():  # a policy a little away from its initialisation, so the two answers differ
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return {"model": model.eval(), "tokenizer": AutoTokenizer.from_pretrained(made["model_path"]),
            "pairs": pairs}


def _pair_batch(quickstart: dict, seq_len: int = 24):
    from fsdpjob.jobs.data.preference import read_pair_table
    from fsdpjob.orchestrator.core.jobspec.dataspec import DataSpec

    data = DataSpec(path=str(quickstart["pairs"]), seq_len=seq_len, packing=False, prompt_field="prompt",
                    chosen_field="chosen", rejected_field="rejected")
    table = read_pair_table(data, quickstart["tokenizer"])
    return table.micro_batch(torch.arange(len(table)))


def _trl_batch(batch, pad_id: int) -> dict[str, torch.Tensor]:
    """The same rows as TRL's collator hands them over: input ids padded with the pad id, the attention mask on the
    real tokens, labels -100 on the prompt and the padding (aligned with the input ids, as TRL's)."""
    positions = torch.arange(batch.chosen_ids.shape[1]).unsqueeze(0)
    out = {}
    for side in ("chosen", "rejected"):
        ids, labels = getattr(batch, f"{side}_ids"), getattr(batch, f"{side}_labels")
        # real tokens: up to the last label (the answer ends the row; its eos is a label)
        last = torch.where(labels != -100, positions, -1).max(dim=1).values
        mask = (positions <= last.unsqueeze(1)).long()
        out |= {f"{side}_input_ids": torch.where(mask.bool(), ids, pad_id), f"{side}_attention_mask": mask,
                f"{side}_labels": labels}
    return out


def test_orpo_total_loss_gradient_and_metrics_are_trls(quickstart):
    from trl.experimental.orpo.orpo_trainer import ORPOTrainer

    from fsdpjob.jobs.data.pairtable import pad_id_of
    from fsdpjob.jobs.preference.batches import orpo_logps
    from fsdpjob.jobs.preference.objective import orpo_objective
    from fsdpjob.jobs.preference.step import ratios
    from fsdpjob.orchestrator.core.jobspec.methods import OrpoSpec

    model, beta = quickstart["model"], 0.1
    batch = _pair_batch(quickstart)
    pairs = len(batch.rows)
    objective = orpo_objective(OrpoSpec(beta=beta))
    logps, counts = orpo_logps(model, batch, CPU)
    out = objective(logps, counts, None, batch)
    ours = out.losses.mean()
    ours.backward()
    our_grad = model.lm_head.weight.grad.clone()
    model.zero_grad(set_to_none=True)
    our_metrics = ratios(torch.cat([out.losses.detach().sum().reshape(1), out.metric_sums]), pairs, objective.metrics)

    accelerator = SimpleNamespace(device=CPU, gather_for_metrics=lambda t: t)
    trainer = SimpleNamespace(beta=beta, accelerator=accelerator, is_encoder_decoder=False, aux_loss_enabled=False,
                              padding_value=pad_id_of(quickstart["tokenizer"]), label_pad_token_id=-100,
                              concatenated_inputs=ORPOTrainer.concatenated_inputs,
                              get_batch_logps=ORPOTrainer.get_batch_logps)
    trainer.odds_ratio_loss = lambda c, r: ORPOTrainer.odds_ratio_loss(trainer, c, r)
    trainer.concatenated_forward = lambda m, b: ORPOTrainer.concatenated_forward(trainer, m, b)
    theirs, their_metrics = ORPOTrainer.get_batch_loss_metrics(trainer, model, _trl_batch(batch, trainer.padding_value))
    theirs.backward()
    their_grad = model.lm_head.weight.grad.clone()
    model.zero_grad(set_to_none=True)

    assert ours.item() == pytest.approx(theirs.item(), rel=1e-6, abs=1e-6)
    assert torch.allclose(our_grad, their_grad, rtol=1e-5, atol=1e-7), (our_grad - their_grad).abs().max()
    for name in ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
                 "logps/rejected", "nll_loss", "log_odds_ratio", "log_odds_chosen"):
        assert our_metrics[name] == pytest.approx(their_metrics[name], rel=1e-5, abs=1e-6), name
    assert -our_metrics["logps/chosen"] < 20, our_metrics  # a per-token mean, not a sum over the answer


CHAT = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{{ eos_token }}{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}")


def _records(quickstart: dict) -> list[dict]:
    """The pair file's records and a few that test the boundary: a prompt ending in a space, an answer that already
    ends with the EOS text, digits that merge across the boundary."""
    eos = quickstart["tokenizer"].eos_token
    rows = [json.loads(line) for line in quickstart["pairs"].read_text().splitlines()]
    return rows + [{"prompt": "12+30= ", "chosen": "42", "rejected": " 41"},
                   {"prompt": "7+8=1", "chosen": "5" + eos, "rejected": "6"}]


def _trl_tokenized(trainer: type, records: list[dict], tokenizer, path: Path) -> list[dict]:
    """``records`` written to ``path`` (for fsdpjob's reader) and tokenized by TRL's own ``trainer._prepare_dataset``
    (called unbound: what it reads of the trainer is the tokenizer, and KTO's whether it builds KL rows: fsdpjob's
    are its own, ktobatch.py)."""
    from datasets import Dataset

    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    config = SimpleNamespace(dataset_num_proc=None, max_length=None, truncation_mode="keep_start")
    stand_in = SimpleNamespace(_tokenizer=tokenizer, calculate_KL=False)
    return list(trainer._prepare_dataset(stand_in, Dataset.from_list(records), tokenizer, config, "train"))


def _data(path: Path, **fields):
    from fsdpjob.orchestrator.core.jobspec.dataspec import DataSpec

    return DataSpec(path=str(path), seq_len=64, packing=False, **fields)


@pytest.mark.parametrize("conversation", [False, True])
def test_pairs_are_tokenized_as_trls_dpo_trainer(quickstart, tmp_path, conversation):
    """The same records through TRL's DPOTrainer._prepare_dataset (its own tokenization) and fsdpjob's reader:
    the same prompt, chosen and rejected ids, pair by pair."""
    from trl.trainer.dpo_trainer import DPOTrainer

    from fsdpjob.jobs.data.preference import read_pairs

    tokenizer = quickstart["tokenizer"]
    records = _records(quickstart)
    if conversation:
        tokenizer = copy.deepcopy(tokenizer)
        tokenizer.chat_template = CHAT
        records = [{"prompt": [{"role": "user", "content": r["prompt"]}],
                    "chosen": [{"role": "assistant", "content": r["chosen"]}],
                    "rejected": [{"role": "assistant", "content": r["rejected"]}]} for r in records]
    path = tmp_path / "pairs.jsonl"
    theirs = _trl_tokenized(DPOTrainer, records, tokenizer, path)
    ours = read_pairs(_data(path, prompt_field="prompt", chosen_field="chosen", rejected_field="rejected"),
                      tokenizer)
    assert len(ours) == len(theirs) == len(records)
    for pair, trl_pair in zip(ours, theirs):
        assert (pair.prompt_ids, pair.chosen_ids, pair.rejected_ids) == (
            trl_pair["prompt_ids"], trl_pair["chosen_ids"], trl_pair["rejected_ids"])


def test_kto_answers_are_tokenized_as_trls_kto_trainer(quickstart, tmp_path):
    from trl.trainer.kto_trainer import KTOTrainer

    from fsdpjob.jobs.data.preference import read_unpaired

    tokenizer = quickstart["tokenizer"]
    records = [{"prompt": r["prompt"], "completion": r[side], "label": side == "chosen"}
               for r in _records(quickstart) for side in ("chosen", "rejected")]
    path = tmp_path / "answers.jsonl"
    theirs = _trl_tokenized(KTOTrainer, records, tokenizer, path)
    ours = read_unpaired(_data(path, prompt_field="prompt", completion_field="completion", label_field="label"),
                         tokenizer)
    assert [(a.prompt_ids, a.completion_ids) for a in ours] == [(t["prompt_ids"], t["completion_ids"]) for t in theirs]
