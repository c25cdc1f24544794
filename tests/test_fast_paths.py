"""Exact-but-faster paths against the plain ones they replace: the (n, s) pair count of the grid prior's EM and the
distinct unit ids a batch of observations touches."""

from __future__ import annotations

import numpy as np
import pytest

from sara.priors.grid import GridPrior, count_pairs, em_weights
from sara.units import UnitTable


@pytest.mark.parametrize("rows", [
    [[1, 0], [1, 1], [8, 3], [1, 0], [8, 8], [2, 0], [8, 3]],   # ordinary (n, s) counts
    [[5, 2]],                                                   # one row
    [[0, 0], [3, 0], [0, 0]],                                   # n = 0 rows
    [[2_000_000, 1], [1, 1], [2_000_000, 1]],                   # too wide for a bincount: the sort path
    [[3, -1], [3, 1], [3, -1]],                                 # negative sums (continuous rewards): the sort path
])
def test_count_pairs_is_np_unique(rows):
    ns = np.asarray(rows, np.int64)
    pairs, counts = count_pairs(ns)
    want_pairs, want_counts = np.unique(ns, axis=0, return_counts=True)
    assert pairs.dtype == want_pairs.dtype and np.array_equal(pairs, want_pairs)
    assert np.array_equal(counts, want_counts)


def test_count_pairs_random_and_em_unchanged():
    rng = np.random.default_rng(0)
    n = rng.integers(1, 9, size=20_000)
    ns = np.stack([n, rng.binomial(n, rng.beta(0.3, 0.3, size=len(n)))], 1).astype(np.int64)
    pairs, counts = count_pairs(ns)
    want_pairs, want_counts = np.unique(ns, axis=0, return_counts=True)
    assert np.array_equal(pairs, want_pairs) and np.array_equal(counts, want_counts)
    grid = GridPrior().grid
    start, prior = np.full(len(grid), 1 / len(grid)), np.full(len(grid), 1 / len(grid))
    plain = em_weights(grid, want_pairs, start, prior, counts=want_counts)
    assert np.array_equal(em_weights(grid, ns, start, prior), plain)  # bit for bit: same rows, same order


@pytest.mark.parametrize("touched", [3, 5_000])  # few ids (sorted unique) and many (a mask over the table)
def test_unit_update_returns_the_sorted_distinct_ids(touched):
    table = UnitTable()
    table.add(np.arange(1_000))
    ids = np.random.default_rng(1).integers(0, 1_000, size=touched)
    got = table.update(ids, np.ones(len(ids)))
    assert got.dtype == np.int64 and np.array_equal(got, np.unique(ids))
    assert table.n.sum() == touched
