"""spmd.pipeline.formats: Parquet, HDF5 and Zarr sources and outputs, in a world of one and of three threads."""

import pickle
import sys

import numpy as np
import pytest

from spmd.errors import MissingExtraError, PipelineError, PipelineValueError, SourceError
from spmd.pipeline.run import Output, SyntheticTable, pipeline
from spmd.pipeline.sources import fingerprint, open_source

from tests.pipeline.test_ranks import at_three

pa = pytest.importorskip("pyarrow", reason="the formats extra: pip install 'spmd[formats]'")
pq = pytest.importorskip("pyarrow.parquet")
h5py = pytest.importorskip("h5py")
zarr = pytest.importorskip("zarr")

pytestmark = pytest.mark.timeout(120)

TABLE = SyntheticTable(5000, 6, seed=3).read(0, 5000)


def _parquet(path, rows, group_rows, names=None, **extra):
    names = names or [f"f{j}" for j in range(rows.shape[1])]
    cols = {n: rows[:, j] for j, n in enumerate(names)}
    pq.write_table(pa.table({**cols, **extra}), path, row_group_size=group_rows)
    return path


def _mlp(block):
    return np.tanh(block @ np.linspace(-1, 1, block.shape[1] * 4, dtype=np.float32).reshape(block.shape[1], 4))


@pytest.mark.unit
def test_a_parquet_dataset_of_files_reads_any_rows_across_row_groups(tmp_path):
    d = tmp_path / "ds"
    d.mkdir()
    for i, (a, b) in enumerate([(0, 1200), (1200, 3100), (3100, 5000)]):
        _parquet(d / f"part{i}.parquet", TABLE[a:b], 500)
    src = open_source(d)
    assert src.shape == (5000, 6) and src.dtype == np.float32 and src.every_rank
    for a, b in [(0, 5000), (450, 1800), (1199, 1201), (4999, 5000), (10, 10)]:
        assert np.array_equal(src.read(a, b), TABLE[a:b]), (a, b)
    assert [n for _, _, n in src.groups][:4] == [500, 500, 200, 500]  # each file's row groups, in order
    again = pickle.loads(pickle.dumps(src))
    assert np.array_equal(again.read(3000, 3200), TABLE[3000:3200])
    assert fingerprint(again) == fingerprint(src)
    picked = open_source(d, columns=["f4", "f1"])
    assert np.array_equal(picked.read(0, 100), TABLE[:100][:, [4, 1]])


@pytest.mark.unit
def test_parquet_columns_of_different_types_become_their_common_type_and_say_so(tmp_path):
    p = _parquet(tmp_path / "t.parquet", TABLE[:100, :2], 64, count=np.arange(100, dtype=np.int64))
    src = open_source(p)
    assert src.dtype == np.float64
    assert "read as float64" in src.notes[0] and "count int64" in src.notes[0]
    assert np.array_equal(src.read(0, 100)[:, 2], np.arange(100))


@pytest.mark.unit
def test_bad_parquet_inputs_are_named_with_the_fix(tmp_path):
    p = _parquet(tmp_path / "s.parquet", TABLE[:10, :2], 5, label=np.array(list("abcdefghij")))
    with pytest.raises(SourceError, match=r"column label \(string\) is not numeric; .*--columns f0,f1"):
        open_source(p)
    with pytest.raises(SourceError, match=r"no column 'zz'; its columns are f0, f1, label"):
        open_source(p, columns=["zz"])
    d = tmp_path / "mixed"
    d.mkdir()
    _parquet(d / "a.parquet", TABLE[:10, :2], 5)
    _parquet(d / "b.parquet", TABLE[:10, :2].astype(np.float64), 5)
    with pytest.raises(SourceError, match="different schemas .*f0, f1"):
        open_source(d)
    whole = _parquet(tmp_path / "w.parquet", TABLE, 1000).read_bytes()
    (tmp_path / "cut.parquet").write_bytes(whole[: len(whole) // 2])
    with pytest.raises(SourceError, match="cut.parquet: not a readable Parquet file.*copied completely"):
        open_source(tmp_path / "cut.parquet")
    nulls = tmp_path / "n.parquet"
    pq.write_table(pa.table({"x": pa.array([1.0, None, 3.0])}), nulls)
    with pytest.raises(SourceError, match="column 'x' holds 1 nulls"):
        open_source(nulls).read(0, 3)


@pytest.mark.unit
def test_an_hdf5_dataset_is_named_by_its_path_and_a_missing_one_lists_the_present(tmp_path):
    p = tmp_path / "sim.h5"
    with h5py.File(p, "w") as f:
        f["runs/a"] = TABLE
        f.create_dataset("runs/cube", data=np.arange(5000 * 12, dtype=np.int32).reshape(5000, 3, 4), chunks=(700, 3, 4))
        f["note"] = "text"
    src = open_source(f"{p}:/runs/a")
    assert (src.shape, src.dtype, src.chunks) == ((5000, 6), np.float32, None)
    assert np.array_equal(src.read(123, 4567), TABLE[123:4567])
    cube = open_source(p, dataset="runs/cube")
    assert cube.shape == (5000, 3, 4) and cube.chunks == (700, 3, 4)
    assert np.array_equal(pickle.loads(pickle.dumps(cube)).read(690, 710), np.arange(5000 * 12).reshape(5000, 3, 4)[690:710])
    with pytest.raises(SourceError, match=r"/runs/b is nothing, not a dataset; its datasets are /note, /runs/a, /runs/cube"):
        open_source(f"{p}:/runs/b")
    with pytest.raises(SourceError, match="holds 3 datasets .*name one"):
        open_source(p)
    with pytest.raises(SourceError, match="not numbers"):
        open_source(f"{p}:/note")
    (tmp_path / "cut.h5").write_bytes(p.read_bytes()[:2000])
    with pytest.raises(SourceError, match="cut.h5: not a readable HDF5 file"):
        open_source(f"{tmp_path / 'cut.h5'}:/runs/a")


@pytest.mark.unit
@pytest.mark.parametrize("fmt", [2, 3])
def test_a_zarr_array_of_either_format_reads_by_chunks(tmp_path, fmt):
    store = tmp_path / "a.zarr"
    arr = zarr.create_array(store=str(store), shape=TABLE.shape, chunks=(900, 6), dtype="float32", zarr_format=fmt)
    arr[:] = TABLE
    src = open_source(store)
    assert (src.shape, src.format, src.chunks) == ((5000, 6), fmt, (900, 6))
    assert np.array_equal(src.read(850, 2000), TABLE[850:2000])
    g = zarr.open_group(str(tmp_path / "g.zarr"), mode="w", zarr_format=fmt)
    g.create_array("inner/x", shape=(10,), dtype="int64")
    with pytest.raises(SourceError, match=r"is a group, not an array; its arrays are /inner/x"):
        open_source(tmp_path / "g.zarr")
    assert open_source(f"{tmp_path / 'g.zarr'}:/inner/x").shape == (10,)


@pytest.mark.unit
@pytest.mark.parametrize("out", ["o.parquet", "o.h5:/res/y", "o.zarr"])
def test_an_output_of_each_format_holds_the_serial_rows_whatever_the_chunks(tmp_path, out):
    expect = _mlp(TABLE)
    first = pipeline(_mlp, TABLE, output=str(tmp_path / f"a-{out}"))
    second = pipeline(_mlp, TABLE, output=str(tmp_path / f"b-{out}"), chunk_rows=777)
    for r in (first, second):
        assert np.array_equal(open_source(str(r.output) + (":/res/y" if ".h5" in out else "")).read(0, 5000), expect)
    assert first.checksum == second.checksum
    name = out.split(":")[0]
    a, b = tmp_path / f"a-{name}", tmp_path / f"b-{name}"
    assert _bytes(a) == _bytes(b)  # the same file, whatever the rounds
    leftovers = sorted(p.name for p in tmp_path.iterdir())
    assert leftovers == sorted([a.name, b.name]), leftovers


def _bytes(path):
    if path.is_dir():
        return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}
    return path.read_bytes()


@pytest.mark.unit
@pytest.mark.parametrize("balance", ["even", "speed", "memory"])
def test_each_zarr_chunk_is_written_whole_by_the_rank_that_owns_it(tmp_path, balance):
    rows = SyntheticTable(60000, 6, seed=5).read(0, 60000)
    src = tmp_path / "in.zarr"
    zarr.create_array(store=str(src), shape=rows.shape, chunks=(1000, 6), dtype="float32")[:] = rows
    serial = pipeline(_mlp, str(src), output=str(tmp_path / "one.zarr"), chunk_rows=10000)
    results, errors, _ = at_three(lambda comm: pipeline(
        _mlp, str(src) if comm.rank == 0 else None, output=str(tmp_path / "three.zarr"), chunk_rows=10000,
        comm=comm, balance=balance, memory="1M,2M,4M" if balance == "memory" else None))
    assert errors == [None] * 3, errors
    res = results[0]
    out = zarr.open_array(str(tmp_path / "three.zarr"), mode="r")
    step = out.chunks[0]
    assert step == 1000  # the input's chunks, kept: the same at any world size
    assert res.write_mode == "parallel" and res.read_mode == "parallel"
    # every share and round ends on a chunk's edge: no chunk is cut, so no two ranks write one
    assert all(n % step == 0 for n in res.rows_per_rank) and sum(n > 0 for n in res.rows_per_rank) >= 2, \
        res.rows_per_rank
    assert np.array_equal(out[:], _mlp(rows)) and res.checksum == serial.checksum
    assert _bytes(tmp_path / "one.zarr") == _bytes(tmp_path / "three.zarr")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.zarr", "one.zarr", "three.zarr"]


@pytest.mark.unit
def test_an_output_takes_its_formats_options_and_refuses_others_before_compute(tmp_path):
    fixed = pipeline(_mlp, TABLE, output=Output(tmp_path / "g.parquet", row_group_rows=1200), chunk_rows=700)
    meta = pq.ParquetFile(fixed.output).metadata
    assert [meta.row_group(i).num_rows for i in range(meta.num_row_groups)] == [1200] * 4 + [200]
    rounds = pipeline(_mlp, TABLE, output=Output(tmp_path / "r.parquet", row_group_rows="round"), chunk_rows=2000)
    meta = pq.ParquetFile(rounds.output).metadata
    assert [meta.row_group(i).num_rows for i in range(meta.num_row_groups)] == [2000, 2000, 1000]
    chunked = pipeline(_mlp, TABLE, output=Output(tmp_path / "c.zarr", chunk_rows=500), chunk_rows=1200)
    assert zarr.open_array(str(chunked.output), mode="r").chunks == (500, 4)
    plain = pipeline(_mlp, TABLE, output=str(tmp_path / "d.zarr"), chunk_rows=1200)  # an array: no chunks to keep
    assert zarr.open_array(str(plain.output), mode="r").chunks == (65536 // 24, 4)  # 64 KiB of input rows
    ran = []

    def fn(block):
        ran.append(1)
        return _mlp(block)

    for output, said in [(Output(tmp_path / "x.h5", row_group_rows=5), r"the HDF5 output takes no option "
                          r"row_group_rows \(it takes: none\)"),
                         (Output(tmp_path / "x.parquet", chunk_rows=5), r"takes no option chunk_rows \(it takes: "
                          r"row_group_rows\)"),
                         (Output(tmp_path / "x.parquet", row_group_rows=0), r"row_group_rows=0; give the rows"),
                         (Output(tmp_path / "x.zarr", chunk_rows="big"), r"chunk_rows='big'; give the rows")]:
        with pytest.raises(PipelineValueError, match=said):
            pipeline(fn, TABLE, output=output)
    assert ran == [] and sorted(p.name for p in tmp_path.iterdir()) == ["c.zarr", "d.zarr", "g.parquet", "r.parquet"]


@pytest.mark.unit
@pytest.mark.parametrize("out", ["o.parquet", "o.h5", "o.zarr"])
def test_three_ranks_read_and_write_each_format_as_one_does(tmp_path, out):
    src = tmp_path / "in.parquet"
    _parquet(src, TABLE, 600)
    serial = pipeline(_mlp, str(src), output=str(tmp_path / f"one-{out}"), chunk_rows=1500)
    results, errors, _ = at_three(lambda comm: pipeline(
        _mlp, str(src) if comm.rank == 0 else None, output=str(tmp_path / f"three-{out}"), chunk_rows=1500,
        comm=comm, balance="speed"))
    assert errors == [None] * 3, errors
    res = results[0]
    assert res.read_mode == "parallel" and res.checksum == serial.checksum
    assert _bytes(tmp_path / f"one-{out}") == _bytes(tmp_path / f"three-{out}")
    if out.endswith((".h5", ".zarr")):
        assert res.write_mode == "parallel"  # every rank at its offsets, or its own chunks
    else:
        assert res.write_mode == "root" and any("root writes" in n for n in res.notes)
    if out.endswith(".parquet"):
        names = pq.read_schema(tmp_path / f"three-{out}").names
        assert names == ["c0", "c1", "c2", "c3"]


@pytest.mark.unit
@pytest.mark.parametrize("out", ["o.parquet", "o.h5", "o.zarr"])
def test_a_resumed_run_of_each_format_ends_as_an_uninterrupted_one(tmp_path, out):
    table = SyntheticTable(20000, 6, seed=3).read(0, 20000)  # a Zarr output's rounds are its chunks: 2730 rows
    whole = pipeline(_mlp, table, output=str(tmp_path / f"whole-{out}"), chunk_rows=1000)
    calls = []

    def dies_at_round_3(block):
        calls.append(block.shape[0])
        if len(calls) == 3:
            raise RuntimeError("killed")
        return _mlp(block)

    target = tmp_path / f"r-{out}"
    with pytest.raises(PipelineError, match="killed"):
        pipeline(dies_at_round_3, table, output=str(target), chunk_rows=1000, resume=True, task="mlp")
    assert not target.exists() and (tmp_path / f"r-{out}.partial").exists()
    done = pipeline(_mlp, table, output=str(target), chunk_rows=700, resume=True, task="mlp")
    assert done.checksum == whole.checksum
    assert _bytes(target) == _bytes(tmp_path / f"whole-{out}")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([target.name, f"whole-{out}"])


@pytest.mark.unit
def test_outputs_the_pipeline_cannot_write_are_refused_before_any_compute(tmp_path):
    ran = []

    def fn(block):
        ran.append(1)
        return block

    with pytest.raises(PipelineValueError, match=r"does not write \.csv files; name a \.npy, \.parquet"):
        pipeline(fn, TABLE, output=str(tmp_path / "o.csv"))
    with pytest.raises(PipelineValueError, match="the directory .*nowhere does not exist"):
        pipeline(fn, TABLE, output=str(tmp_path / "nowhere" / "o.parquet"))
    (tmp_path / "plain.zarr").mkdir()
    (tmp_path / "plain.zarr" / "notes.txt").write_text("mine")
    with pytest.raises(PipelineValueError, match="exists and is not a Zarr store"):
        pipeline(fn, TABLE, output=str(tmp_path / "plain.zarr"))
    assert ran == []
    with pytest.raises(PipelineError, match="a Parquet file holds columns.*shape \\(2, 3\\)"):
        pipeline(lambda b: b.reshape(-1, 2, 3), TABLE, output=str(tmp_path / "o.parquet"))


@pytest.mark.unit
def test_a_missing_library_names_the_extra(monkeypatch, tmp_path):
    p = _parquet(tmp_path / "t.parquet", TABLE[:10], 5)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)  # import fails as if not installed
    with pytest.raises(MissingExtraError, match=r"reading Parquet needs the pyarrow package.*pip install 'spmd\[formats\]'"):
        open_source(p)


@pytest.mark.unit
def test_a_rank_whose_files_differ_from_roots_does_not_read_them(tmp_path):
    from spmd.pipeline import agree
    from spmd.pipeline.plan import Options, Plan

    p = _parquet(tmp_path / "t.parquet", TABLE, 1000)
    src = open_source(p)
    plan = Plan(rows=5000, chunk=1000, shape=(5000, 6), dtype="float32", in_row_bytes=24, positional=False,
                resume=False, checksum="crc32", forced=False, why_root="", shared=pickle.dumps(src),
                identity=src.identity())
    mine, opened = agree.report(plan, Options(), 1, 0)
    assert mine.read is None and opened is not None
    _parquet(p, TABLE * 2, 1000)  # the same shape and schema, other rows: other footer statistics
    mine, opened = agree.report(plan, Options(), 1, 0)
    assert opened is None and "its files differ from root's" in mine.read


@pytest.mark.unit
@pytest.mark.parametrize("out", ["o.parquet", "o.h5", "o.zarr"])
def test_verify_recomputes_every_round_of_each_format(tmp_path, out):
    src = tmp_path / "in.h5"
    with h5py.File(src, "w") as f:
        f["t"] = TABLE
    results, errors, _ = at_three(lambda comm: pipeline(
        _mlp, str(src) if comm.rank == 0 else None, output=str(tmp_path / out), chunk_rows=1200, verify=True,
        comm=comm))
    assert errors == [None] * 3, errors
    assert results[0].verified is True and results[0].mismatched_rows == 0
    assert results[0].write_mode == "root"  # verify: the rows come to root
    assert np.array_equal(open_source(str(tmp_path / out) + (":/data" if out.endswith(".h5") else "")).read(0, 5000),
                          _mlp(TABLE))


@pytest.mark.unit
def test_the_libraries_a_run_will_import_are_named_from_its_paths_alone(tmp_path):
    from spmd.pipeline.formats.names import libraries

    store = tmp_path / "plain"  # a store by its metadata, not its name
    zarr.create_array(store=str(store), shape=(4,), dtype="float32")
    (tmp_path / "ds").mkdir()
    (tmp_path / "ds" / "part0.parquet").write_bytes(b"")
    assert libraries(str(store), Output(tmp_path / "o.h5")) == ["h5py", "zarr"]
    assert libraries([str(tmp_path / "a.pq"), tmp_path / "b.pq"], "f.hdf5:/x/y") == ["h5py", "pyarrow.parquet"]
    assert libraries(tmp_path / "ds", None) == ["pyarrow.parquet"]
    assert libraries(TABLE, lambda: 1, "a.npy", str(tmp_path / "missing" / "x.csv"), tmp_path / "nope") == []


@pytest.mark.unit
def test_a_rank_finishes_importing_the_format_before_it_waits_for_roots_open(tmp_path, monkeypatch):
    # a rank waiting in an MPI call polls: its import beside it would take a core's worth longer
    import threading
    import time
    from types import SimpleNamespace

    from spmd.pipeline import ranks as ranks_module
    from spmd.pipeline.formats import extra

    events = []
    real = extra.importlib.import_module

    def slow_import(name):  # the pipeline's early import of the format's library, made slow
        if name == "pyarrow.parquet":
            time.sleep(0.3)
            events.append(("imported", threading.current_thread().name))
        return real(name)

    made = ranks_module.Ranks.__init__

    def past_reply(self, comm, *args):
        events.append(("past the reply", threading.current_thread().name, comm.rank))
        made(self, comm, *args)

    monkeypatch.setattr(extra, "importlib", SimpleNamespace(import_module=slow_import))
    monkeypatch.setattr(ranks_module.Ranks, "__init__", past_reply)
    src = _parquet(tmp_path / "in.parquet", TABLE, 1000)
    results, errors, _ = at_three(lambda comm: pipeline(_mlp, src if comm.rank == 0 else None, comm=comm,
                                                        chunk_rows=1500))
    assert errors == [None] * 3, errors
    assert np.array_equal(results[0].output, _mlp(TABLE))
    others = [(e[1], e[2]) for e in events if e[0] == "past the reply" and e[2] != 0]
    assert len(others) == 2, events
    for name, rank in others:
        assert events.index(("imported", name)) < events.index(("past the reply", name, rank)), events
