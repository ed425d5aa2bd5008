"""spmd.pipeline.run: pipeline() and on_root() in a world of one and under launchers."""

import subprocess
import sys

import numpy as np
import pytest

from spmd.pipeline import checksum
from spmd.pipeline import tasks
from spmd.pipeline.run import PipelineError, SyntheticTable, on_root, pipeline

from tests.support import MPIRUN, PY, REPO, WORLDS, clean_env, run, tool

pytestmark = pytest.mark.timeout(120)


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


def _double(block):
    return block * np.float32(2)


@pytest.mark.unit
@pytest.mark.parametrize("overlap", [True, False])
def test_every_mode_in_a_world_of_one_writes_the_same_file(tmp_path, overlap):
    src = SyntheticTable(3001, 5, seed=2)
    want = src.read(0, 3001) * 2
    for i, (read, write) in enumerate([("auto", "auto"), ("root", "root"), ("parallel", "parallel")]):
        out = tmp_path / f"{i}.npy"
        r = pipeline(_double, src, output=out, chunk_rows=400, read=read, write=write, overlap=overlap,
                     balance="speed")
        assert np.array_equal(np.load(out), want) and r.checksum == checksum.get().of(want)
        assert (r.read_mode, r.write_mode) == ("root" if read == "root" else "parallel",
                                               "root" if write == "root" else "parallel")
        assert r.rounds == 10 and r.rows_processed == 3001  # speed: two probe rounds of 100 first
        assert f"read {r.read_mode}" in r.summary()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["0.npy", "1.npy", "2.npy"]


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
                                  "on rank 0: output /nonexistent/dir/out.npy: the directory /nonexistent/dir "
                                  "does not exist"]):
        lines = sorted(line.split(": ", 1)[1] for line in out.splitlines() if line.startswith(f"CASE {case} "))
        assert len(lines) == 3 and len(set(lines)) == 1 and words in lines[0], (case, lines, out[-3000:])


@pytest.mark.launcher
@pytest.mark.timeout(200)
def test_every_mode_gives_the_same_bytes_at_three_ranks_under_mpirun(tmp_path):
    if MPIRUN is None:
        pytest.skip("mpirun not found")
    cmd, env = [MPIRUN, "-n", 3, PY], clean_env(SPMD_BACKEND="mpi")
    result = run(cmd + [WORLDS / "pipeline_modes.py", tmp_path], 180, env=env)
    assert result.returncode == 0 and "MODES OK size 3" in result.stdout, result.stdout[-5000:]
    assert result.stdout.count("CASE rank 0: mode") == 6, result.stdout[-3000:]


@pytest.mark.launcher
@pytest.mark.spmd(ranks=3, timeout=180)
def test_every_mode_gives_the_same_bytes_at_three_ranks_on_gloo(comm, tmp_path, monkeypatch, capsys):
    import runpy

    monkeypatch.setattr(sys, "argv", ["pipeline_modes.py", str(tmp_path)])
    runpy.run_path(str(WORLDS / "pipeline_modes.py"), run_name="__main__")
    out = capsys.readouterr().out
    if comm.rank == 0:  # rank 0 speaks for the world
        assert out.count("CASE rank 0: mode") == 6 and "MODES OK size 3" in out, out[-3000:]
