"""A data mixture's epochs: which rows of the packed table each epoch of the batch stream takes.

The table holds the rows of every source (sources are packed apart, so each row has one source), and
``source[r]`` says whose row r is. An epoch has as many rows as the table, shared out by the weights; source
i gives c_i of them: draws e*c_i .. (e+1)*c_i - 1 of an endless run of passes over its rows, each pass a
permutation fixed by (seed, i, pass). So a source smaller than its share repeats (each of its rows once per
pass), a larger one is cycled through over the epochs, and no row comes twice before all of its source's
rows came once. The epoch's rows are then shuffled from (seed, epoch), or without shuffle interleaved evenly.

Everything is a function of (seed, epoch): BatchStream's position counter stays its only state, so resuming,
also on another world size, continues at the exact next sample as it does without a mixture.
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch

_MASK = np.uint64(0xFFFFFFFFFFFFFFFF)


def _seed(*parts: object) -> int:
    digest = hashlib.sha256(":".join(["fsdpjob-mixture", *map(str, parts)]).encode()).digest()
    return int.from_bytes(digest[:8], "little")


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer: uint64 arithmetic wraps in numpy, so each key is a fixed function of its input."""
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return (x ^ (x >> np.uint64(31))) & _MASK


def epoch_counts(sizes: list[int], weights: tuple[float, ...]) -> list[int]:
    """Rows each source gives an epoch: its weight's share of all rows (largest remainder), at least one."""
    total, norm = sum(sizes), sum(weights)  # weights add up to 1 within the spec's tolerance: normalise exactly
    quotas = [w / norm * total for w in weights]
    counts = [int(q) for q in quotas]
    by_remainder = sorted(range(len(quotas)), key=lambda i: (counts[i] - quotas[i], i))
    for i in by_remainder[: max(0, total - sum(counts))]:
        counts[i] += 1
    return [max(1, c) for c in counts]


def _groups(source: torch.Tensor, n_sources: int) -> list[torch.Tensor]:
    groups = [torch.nonzero(source == i).flatten() for i in range(n_sources)]
    if empty := [i for i, g in enumerate(groups) if not len(g)]:
        raise ValueError(f"data source {empty[0]} has no training sequences (data.eval_fraction held out all of "
                         "them?); lower eval_fraction or give that source more data")
    return groups


def epoch_size(source: torch.Tensor, weights: tuple[float, ...]) -> int:
    return sum(epoch_counts([len(g) for g in _groups(source, len(weights))], weights))


def _draws(group: torch.Tensor, count: int, *, seed: int, epoch: int, shuffle: bool) -> torch.Tensor:
    """Rows of one source for ``epoch``: its draws epoch*count .. (epoch+1)*count - 1 over its passes."""
    n = len(group)
    k = np.arange(epoch * count, (epoch + 1) * count, dtype=np.int64)
    passes = k // n
    if not shuffle:
        return group[torch.from_numpy(k % n)]
    # Each pass's order sorts the rows by a hash of (seed, pass, row): computed for the passes this epoch touches
    # only, all at once, and the same whichever epoch asks (a pass may straddle two).
    first, last = int(passes[0]), int(passes[-1])
    cells = np.arange(first, last + 1, dtype=np.uint64)[:, None] * np.uint64(n) + np.arange(n, dtype=np.uint64)
    orders = np.argsort(_mix(cells ^ np.uint64(seed)), axis=1, kind="stable")
    return group[torch.from_numpy(orders[passes - first, k % n])]


def epoch_rows(source: torch.Tensor, weights: tuple[float, ...], *, seed: int, epoch: int,
               shuffle: bool) -> torch.Tensor:
    """The table rows of ``epoch``, in the order the stream takes them."""
    groups = _groups(source, len(weights))
    counts = epoch_counts([len(g) for g in groups], weights)
    rows = torch.cat([_draws(g, c, seed=_seed(seed, i), epoch=epoch, shuffle=shuffle)
                      for i, (g, c) in enumerate(zip(groups, counts))])
    if shuffle:
        gen = torch.Generator().manual_seed(_seed(seed, "epoch", epoch) & (2**63 - 1))
        return rows[torch.randperm(len(rows), generator=gen)]
    # Evenly interleaved: source i's j-th row sits at (j + 1/2) / c_i of the epoch.
    keys = torch.cat([(torch.arange(c, dtype=torch.float64) + 0.5) / c for c in counts])
    return rows[torch.sort(keys, stable=True).indices]
