"""spmd.pipeline and spmd.tasks in a world of one: plain calls, no launcher."""

import subprocess
import sys

import numpy as np
import pytest

from spmd.pipeline import checksum
from spmd.pipeline import tasks
from spmd.pipeline.run import (
    ArraySource,
    CsvSource,
    NpySource,
    PipelineError,
    ShardSource,
    SyntheticTable,
    on_root,
    open_source,
    pipeline,
)

from tests.support import REPO, clean_env

pytestmark = pytest.mark.timeout(120)

# row counts that cut the micro-batches, the synthetic blocks and each other awkwardly
SPLITS = [1, 2, 3, 7, 8, 13, 100, 1023, 1024, 1025, 2049, 3000]


def crc(a):
    """The checksum the pipeline reports in this process (crc32c where installed, else zlib's crc32)."""
    return checksum.get().of(a)


@pytest.fixture(scope="module")
def table():
    return SyntheticTable(3001, 16, seed=5).read(0, 3001)


@pytest.mark.unit
def test_plain_call_returns_results_in_order_with_counts_and_checksums(table):
    result = pipeline(lambda block: block[:, :3] * 2, table)
    assert np.array_equal(result.output, table[:, :3] * 2)
    assert (result.rows, result.ranks, result.backend, result.rounds) == (3001, 1, "serial", 1)
    assert result.row_shape == (3,) and result.dtype == "float32"
    assert result.checksum == crc(table[:, :3] * 2)
    assert result.input_checksum == crc(table)
    assert result.rows_per_rank == [3001] and len(result.process_per_rank) == 1
    assert {"load", "scatter", "process", "gather", "write"} <= set(result.timings)
    assert result.verified is None and result.rows_per_second > 0
    text = result.summary()
    assert result.rows_out == 3001
    for words in ("3001 rows in, 3001 out (3 float32 each)", "1 rank, backend serial", "1 round of",
                  "load", "rows/s", f"{result.checksum:08x}"):
        assert words in text


@pytest.mark.unit
def test_chunked_output_file_is_identical_and_progress_reported(table, tmp_path):
    whole = pipeline(lambda b: b + 1, table, output=tmp_path / "whole.npy")
    seen = []
    chunked = pipeline(lambda b: b + 1, table, output=tmp_path / "chunked.npy", chunk_rows=1000,
                       progress=lambda done, total: seen.append((done, total)))
    assert whole.output == tmp_path / "whole.npy"
    assert (tmp_path / "whole.npy").read_bytes() == (tmp_path / "chunked.npy").read_bytes()
    assert np.array_equal(np.load(tmp_path / "chunked.npy"), table + 1)
    assert chunked.rounds == 4 and chunked.checksum == whole.checksum
    assert seen == [(1000, 3001), (2000, 3001), (3000, 3001), (3001, 3001)]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chunked.npy", "whole.npy"]  # no leftovers


@pytest.mark.unit
def test_callable_output_gets_start_rows(table):
    got = []
    result = pipeline(lambda b: b[:, 0], table, output=lambda start, block: got.append((start, len(block))),
                      chunk_rows=2000)
    assert got == [(0, 2000), (2000, 1001)] and result.output is None


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


@pytest.mark.unit
def test_verify_catches_a_function_that_depends_on_batching(table):
    ok = pipeline(tasks.get("mlp").make(16, 0, None), table, chunk_rows=1000, verify=True)
    assert ok.verified is True and ok.mismatched_rows == 0 and "identical" in ok.summary()
    calls = []  # a function that gives a different answer on every call

    def drifting(b):
        calls.append(1)
        return b + len(calls)

    bad = pipeline(drifting, table, chunk_rows=1000, verify=True)
    assert bad.verified is False and bad.mismatched_rows == 3001 and bad.first_mismatch == 0
    assert "FAILED" in bad.summary()


@pytest.mark.unit
def test_tensor_results_are_accepted(table):
    torch = pytest.importorskip("torch")
    result = pipeline(lambda b: torch.from_numpy(b).double().sum(1, keepdim=True), table)
    assert result.dtype == "float64" and result.row_shape == (1,)


@pytest.mark.unit
def test_no_rows_gives_an_empty_output_of_the_right_shape(tmp_path):
    fn = tasks.get("standardize").make(4, 0, (np.zeros(4), np.ones(4)))
    result = pipeline(fn, np.zeros((0, 4), np.float32), output=tmp_path / "e.npy")
    assert result.rows == 0 and result.rounds == 1
    assert np.load(tmp_path / "e.npy").shape == (0, 8)


@pytest.mark.unit
def test_errors_are_pipeline_errors_with_the_reason(table, tmp_path):
    with pytest.raises(PipelineError, match="one row per input row"):
        pipeline(lambda b: b[:1], table)
    with pytest.raises(PipelineError, match="fn failed on rank 0 of 1, rows 0 to 3001: ZeroDivisionError"):
        pipeline(lambda b: 1 / 0, table)
    with pytest.raises(PipelineError, match="no such file"):
        pipeline(lambda b: b, tmp_path / "missing.npy")
    with pytest.raises(PipelineError, match="no .npy shards in this directory"):
        pipeline(lambda b: b, tmp_path)
    (tmp_path / "x.txt").write_text("1,2\n")
    with pytest.raises(PipelineError, match="unknown input format"):
        pipeline(lambda b: b, tmp_path / "x.txt")
    with pytest.raises(PipelineError, match="must return a numpy array"):
        pipeline(lambda b: b.tolist(), table)
    calls = []

    def second_round_fails(block):
        calls.append(1)
        if len(calls) == 2:
            raise ValueError("round two")
        return block

    with pytest.raises(PipelineError, match="round two"):
        pipeline(second_round_fails, table, output=tmp_path / "o.npy", chunk_rows=1000)
    assert not (tmp_path / "o.npy").exists()

    def fails():
        raise ValueError("nope")

    with pytest.raises(PipelineError, match="on rank 0: ValueError: nope"):
        on_root(fails)
    assert on_root(lambda: 42, share=True) == 42
    with pytest.raises(ValueError, match="unknown task 'nope'; expected one of copy, mlp, standardize"):
        tasks.get("nope")
    assert not list(tmp_path.glob(".*spmd-tmp*"))


@pytest.mark.unit
def test_importing_spmd_pipeline_and_tasks_does_not_import_torch():
    code = "import sys, spmd, spmd.pipeline, spmd.tasks; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], env=clean_env(), cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr


USER_SCRIPT = '''
import numpy as np
from spmd import comm
from spmd.pipeline.run import PipelineError, pipeline

table = np.arange(46.0).reshape(23, 2) if comm.rank == 0 else None
result = pipeline(lambda block: block * 2, table, chunk_rows=7, verify=True)
if comm.rank == 0:
    assert np.array_equal(result.output, table * 2) and result.verified, result
    assert result.rows_per_rank == [10, 7, 6], result.rows_per_rank  # rounds of 7, 7, 7, 2
    print("USER OK", result.rows, result.ranks, result.rounds, flush=True)
else:
    assert result is None


def fails_on_1(block):
    if comm.rank == 1:
        raise KeyError("boom")
    return block


cases = [
    (fails_on_1, None),
    (lambda b: b.astype(np.float32) if comm.rank == 1 else b, None),
    (lambda b: b, "/nonexistent/dir/out.npy"),
]
for i, (fn, output) in enumerate(cases):
    try:
        pipeline(fn, table, output=output, chunk_rows=10)
    except PipelineError as exc:
        print(f"CASE {i} rank {comm.rank}: {exc}", flush=True)
'''


@pytest.mark.launcher
@pytest.mark.timeout(120)
def test_a_users_pipeline_at_size_3_and_errors_raised_alike_on_every_rank(tmp_path):
    from tests.support import MPIRUN, PY, run

    if MPIRUN is None:
        pytest.skip("mpirun not found")
    script = tmp_path / "mine.py"
    script.write_text(USER_SCRIPT)
    result = run([MPIRUN, "-n", 3, PY, script], timeout=100, env=clean_env(SPMD_BACKEND="mpi"))
    out = result.stdout
    assert result.returncode == 0 and "USER OK 23 3 4" in out, out[-3000:]
    for case, words in enumerate(["fn failed on rank 1 of 3, rows 0 to 10: KeyError: 'boom'",
                                  "same dtype and row shape on every rank",
                                  "on rank 0: making the output: FileNotFoundError"]):
        lines = sorted(line.split(": ", 1)[1] for line in out.splitlines() if line.startswith(f"CASE {case} "))
        assert len(lines) == 3 and len(set(lines)) == 1 and words in lines[0], (case, lines, out[-3000:])
