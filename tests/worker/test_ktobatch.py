"""KTO's mismatched KL rows (jobs/preference/ktobatch.py): each row's partner is fixed by the seed (one cycle
through the table, never the row itself), a KL row is the row's prompt with its partner's answer, cut at seq_len
and right-padded, labelled on the answer only; the table's micro-batches carry them and its fingerprint keys the
partners."""

from __future__ import annotations

import pytest
import torch

from fsdpjob.jobs.data.examples import IGNORE
from fsdpjob.jobs.data.pairtable import UnpairedTable
from fsdpjob.jobs.preference.batches import answer_rows
from fsdpjob.jobs.preference.ktobatch import KtoTable, kl_partners, mismatched_rows, prompt_lengths

PAD = 0


def _table(rows: list[tuple[list[int], list[int]]], seq_len: int) -> UnpairedTable:
    ids = torch.full((len(rows), seq_len), PAD)
    labels = torch.full((len(rows), seq_len), IGNORE)
    for r, (prompt, answer) in enumerate(rows):
        n = len(prompt) + len(answer)
        ids[r, :n] = torch.tensor(prompt + answer)
        labels[r, len(prompt):n] = torch.tensor(answer)
    lengths = torch.tensor([len(p) + len(a) for p, a in rows])
    return UnpairedTable(ids, labels, torch.arange(len(rows)) % 2 == 0, torch.arange(len(rows)), lengths)


def test_the_partners_are_one_cycle_fixed_by_the_seed():
    partners = kl_partners(50, seed=3)
    assert torch.equal(partners, kl_partners(50, seed=3))
    assert not torch.equal(partners, kl_partners(50, seed=4))
    assert sorted(partners.tolist()) == list(range(50))  # a permutation: every answer is some row's KL answer
    seen, row = set(), 0
    while row not in seen:  # one cycle through all rows: no row is its own partner
        seen.add(row)
        row = int(partners[row])
    assert len(seen) == 50
    assert kl_partners(1, seed=0).tolist() == [0]


def test_a_kl_row_is_the_prompt_with_the_other_answer_cut_and_padded():
    table = _table([([1, 2, 3], [4, 5]), ([7, 8], [9, 10, 11, 12])], seq_len=6)
    prompt_len = prompt_lengths(table.labels, table.lengths)
    assert prompt_len.tolist() == [3, 2]
    partner = torch.tensor([1, 0])
    ids, labels = mismatched_rows(table.ids, prompt_len, table.ids[partner], table.labels[partner], pad_id=PAD)
    assert ids.tolist() == [[1, 2, 3, 9, 10, 11], [7, 8, 4, 5, PAD, PAD]]  # row 0's answer cut at seq_len
    assert labels.tolist() == [[IGNORE] * 3 + [9, 10, 11], [IGNORE] * 2 + [4, 5, IGNORE, IGNORE]]


def test_the_table_gives_micro_batches_with_their_kl_rows_and_keys_its_partners():
    base = _table([([1, 2], [3]), ([4], [5, 6]), ([7, 8, 9], [10])], seq_len=5)
    table = KtoTable.of(base, seed=0, pad_id=PAD)
    batch = table.micro_batch(torch.tensor([2, 0]))
    for b, row in enumerate([2, 0]):
        partner = int(table.partners[row])
        prompt = base.ids[row, :int(prompt_lengths(base.labels, base.lengths)[row])].tolist()
        answer = base.ids[partner][base.labels[partner] != IGNORE].tolist()
        assert batch.kl_ids[b].tolist() == (prompt + answer + [PAD] * 5)[:5]
    ids, labels = answer_rows(batch)
    assert torch.equal(ids, torch.cat([base.ids[[2, 0]], batch.kl_ids]))
    assert torch.equal(labels, torch.cat([base.labels[[2, 0]], batch.kl_labels]))
    assert len(table) == 3 and torch.equal(table.row_tokens(), base.row_tokens())
    kl_lengths = prompt_lengths(base.labels, base.lengths) + (base.labels != IGNORE).sum(1)[table.partners]
    assert torch.equal(table.row_lengths(), base.lengths + kl_lengths)
    assert table.fingerprint() != base.fingerprint()
    assert table.fingerprint() == KtoTable.of(base, seed=0, pad_id=PAD).fingerprint()
    assert table.fingerprint() != KtoTable.of(base, seed=1, pad_id=PAD).fingerprint()


def test_the_kto_objective_uses_the_ranks_mean_kl_and_counts_each_labels_metrics():
    from types import SimpleNamespace

    from fsdpjob.jobs.preference.losses import kto_kl, kto_loss
    from fsdpjob.jobs.preference.objective import KTO_SUMS, kto_objective
    from fsdpjob.orchestrator.core.jobspec.methods import KtoSpec

    options = KtoSpec(beta=0.5, desirable_weight=1.0, undesirable_weight=2.0)
    seen = []

    def rank_mean(kl):  # as if the other rank's estimate were 0.4 higher (2 ranks)
        seen.append(kl)
        return kl + 0.2

    answers, kl_rows = torch.tensor([-3.0, -5.0, -4.0]), torch.tensor([-6.0, -7.0, -5.0])
    reference = torch.tensor([[-3.5, -6.5], [-4.0, -7.5], [-4.5, -5.2]])
    batch = SimpleNamespace(desirable=torch.tensor([True, False, True]))
    out = kto_objective(options, rank_mean)(torch.cat([answers, kl_rows]), torch.ones(6), reference, batch)
    kl = kto_kl(kl_rows, reference[:, 1]) + 0.2
    assert len(seen) == 1 and torch.allclose(seen[0], kto_kl(kl_rows, reference[:, 1]))
    expected = kto_loss(answers, reference[:, 0], batch.desirable, kl, beta=0.5, desirable_weight=1.0,
                        undesirable_weight=2.0)
    assert kl > 0 and torch.allclose(out.losses, expected.losses)
    sums = dict(zip(KTO_SUMS, out.metric_sums.tolist()))
    rewards = 0.5 * (answers - reference[:, 0])
    assert sums["kl"] == pytest.approx(float(kl)) and sums["micro_batches"] == 1
    assert sums["chosen"] == 2 and sums["rejected"] == 1
    assert sums["rewards/chosen"] == pytest.approx(float(rewards[0] + rewards[2]))
    assert sums["rewards/rejected"] == pytest.approx(float(rewards[1]))
    assert sums["logps/chosen"] == pytest.approx(-7.0) and sums["logps/rejected"] == pytest.approx(-5.0)
