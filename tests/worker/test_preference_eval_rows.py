"""Which eval rows each rank evaluates (jobs/preference/evaluate.py eval_rows): every row once over the ranks,
the same number of micro-batches on every rank (the extra ones marked None: they count nothing)."""

from __future__ import annotations

import pytest

from fsdpjob.jobs.preference.evaluate import eval_rows


@pytest.mark.parametrize(("total", "mb", "world"), [(10, 2, 2), (10, 3, 4), (1, 2, 3), (7, 1, 2), (8, 4, 2)])
def test_every_row_once_and_the_same_number_of_forwards_on_every_rank(total, mb, world):
    ranks = [eval_rows(total, mb, rank, world) for rank in range(world)]
    assert len({len(r) for r in ranks}) == 1, ranks
    seen = [int(i) for r in ranks for rows in r if rows is not None for i in rows]
    assert seen == list(range(total))
    assert all(len(rows) <= mb for r in ranks for rows in r if rows is not None)
