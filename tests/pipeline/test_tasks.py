"""spmd.pipeline.tasks (spmd.tasks): the registry, fixed batches, column statistics, build."""

import numpy as np
import pytest

from spmd.pipeline import tasks
from spmd.pipeline.sources import ArraySource, SyntheticTable

pytestmark = pytest.mark.timeout(120)

SPLITS = [1, 2, 3, 7, 8, 13, 100, 1023, 1024, 1025, 2049, 3000]


@pytest.fixture(scope="module")
def table():
    return SyntheticTable(3001, 16, seed=5).read(0, 3001)


@pytest.mark.unit
@pytest.mark.parametrize("name", ["mlp", "standardize", "copy"])
def test_tasks_give_the_same_bits_however_rows_are_batched(name, table):
    task = tasks.get(name)
    stats = tasks.column_stats(ArraySource(table)) if task.needs_stats else None
    fn = task.make(16, 0, stats)
    ref = fn(table)
    assert ref.shape[0] == len(table)
    for s in SPLITS:
        assert np.array_equal(ref, np.concatenate([fn(table[:s]), fn(table[s:])])), f"split at {s}"
    assert np.array_equal(ref, np.concatenate([fn(p) for p in np.array_split(table, 7)]))
    assert fn(table[:0]).shape == (0,) + ref.shape[1:]
    again = task.make(16, 0, stats)  # same seed, same weights: what every rank builds
    assert np.array_equal(again(table), ref)


@pytest.mark.unit
def test_column_stats_are_global_and_independent_of_reading():
    src = SyntheticTable(200_003, 3, seed=1)
    mean, std = tasks.column_stats(src)
    direct = src.read(0, src.rows).astype(np.float64)
    assert np.allclose(mean, direct.mean(0), rtol=0, atol=1e-9)
    assert np.allclose(std, direct.std(0), rtol=1e-9)
    assert all(np.array_equal(x, y) for x, y in zip(tasks.column_stats(ArraySource(direct)), (mean, std)))


@pytest.mark.unit
def test_build_reads_features_and_stats_from_the_source(table):
    fn = tasks.build("standardize", table, seed=0)
    stats = tasks.column_stats(ArraySource(table))
    assert np.array_equal(fn(table), tasks.get("standardize").make(16, 0, stats)(table))
    out = fn(table).astype(np.float64)
    assert out.shape == (3001, 8) and abs(out.mean()) < 0.1
