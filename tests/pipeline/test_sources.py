"""spmd.pipeline.sources: arrays, .npy files, shard folders, .csv files, synthetic tables, fingerprints."""

import pickle

import numpy as np
import pytest

from spmd.pipeline import tasks
from spmd.pipeline.run import pipeline
from spmd.pipeline.sources import CsvSource, NpySource, ShardSource, SyntheticTable, fingerprint, open_source

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def table():
    return SyntheticTable(3001, 16, seed=5).read(0, 3001)


@pytest.mark.unit
def test_sources_npy_shards_csv_and_callable(table, tmp_path):
    np.save(tmp_path / "t.npy", table)
    shards = tmp_path / "shards"
    shards.mkdir()
    cuts = [0, 500, 501, 501, 2000, 3001]  # an empty shard too; part10 comes after part2
    for i, (a, b) in enumerate(zip(cuts[:-1], cuts[1:])):
        np.save(shards / f"part{[1, 2, 10, 11, 20][i]}.npy", table[a:b])
    np.savetxt(tmp_path / "t.csv", table, delimiter=",", fmt="%.9g", header="a,b,c,d,e,f,g,h,i,j,k,l,m,n,o,p",
               comments="")
    assert isinstance(open_source(tmp_path / "t.npy"), NpySource)
    assert isinstance(open_source(str(shards)), ShardSource)
    assert isinstance(open_source(tmp_path / "t.csv"), CsvSource)
    assert open_source(tmp_path / "t.csv").shape == (3001, 16)
    fn = tasks.get("copy").make(16, 0, None)
    for spec in (tmp_path / "t.npy", shards, lambda: table):
        assert np.array_equal(pipeline(fn, spec, chunk_rows=777).output, table), spec
    from_csv = pipeline(fn, tmp_path / "t.csv", chunk_rows=777).output
    assert from_csv.dtype == np.float64 and np.array_equal(from_csv.astype(np.float32), table)


@pytest.mark.unit
def test_synthetic_ranges_do_not_depend_on_how_the_table_is_cut():
    src = SyntheticTable(70000, 5, seed=9)
    whole = src.read(0, 70000)
    assert whole.shape == (70000, 5) and whole.dtype == np.float32
    for a, b in [(0, 1), (65535, 65537), (100, 69999), (69999, 70000), (3, 3)]:
        assert np.array_equal(SyntheticTable(70000, 5, seed=9).read(a, b), whole[a:b]), (a, b)
    assert not np.array_equal(SyntheticTable(10, 5, seed=10).read(0, 10), whole[:10])


@pytest.mark.unit
def test_fingerprint_tells_inputs_apart_cheaply(tmp_path):
    a = np.arange(4000.0).reshape(1000, 4)
    np.save(tmp_path / "a.npy", a)
    b = a.copy()
    b[0, 1] = -1  # a sampled row (fingerprint reads 17 rows, the first and last among them)
    np.save(tmp_path / "b.npy", b)
    fa, fb = fingerprint(NpySource(tmp_path / "a.npy")), fingerprint(NpySource(tmp_path / "b.npy"))
    assert fa != fb and fa == fingerprint(NpySource(tmp_path / "a.npy"))
    assert fingerprint(SyntheticTable(10, 2, 3)) == "synthetic 10x2 seed 3" != fingerprint(SyntheticTable(10, 2, 4))


@pytest.mark.unit
def test_sources_every_rank_can_read_pickle_to_a_fresh_copy(tmp_path):
    np.save(tmp_path / "t.npy", np.arange(12.0).reshape(6, 2))
    for src in (NpySource(tmp_path / "t.npy"), SyntheticTable(100, 3, 1)):
        copy = pickle.loads(pickle.dumps(src))
        assert src.every_rank and copy.shape == src.shape and np.array_equal(copy.read(2, 5), src.read(2, 5))
