"""Parquet, HDF5 and Zarr under real launchers: 3 ranks reading and writing in parallel, every balance, and a
run SIGKILLed halfway resumed at another world size, each ending with the bytes of a serial run."""

import os
import re

import numpy as np
import pytest

from spmd.pipeline import journal
from spmd.pipeline.run import SyntheticTable, pipeline
from spmd.pipeline.sinks import partial_path
from spmd.pipeline.sources import open_source

from tests.pipeline.test_journal import CHUNK, ROWS, kill_halfway, reference, two_sizes
from tests.support import MPIRUN, PY, REPO, WORLDS, clean_env, run, tool

pa = pytest.importorskip("pyarrow", reason="the formats extra: pip install 'spmd[formats]'")
pq = pytest.importorskip("pyarrow.parquet")
h5py = pytest.importorskip("h5py")
zarr = pytest.importorskip("zarr")

FORMATS = ("parquet", "h5", "zarr")


def write_input(path, rows):
    """Save rows (2-D float32) at path in the format its ending names; return the path as the job takes it."""
    if path.suffix == ".parquet":
        pq.write_table(pa.table({f"x{j}": rows[:, j] for j in range(rows.shape[1])}), path, row_group_size=4096)
    elif path.suffix == ".h5":
        with h5py.File(path, "w") as f:
            f.create_dataset("table", data=rows, chunks=(3000, rows.shape[1]))
        return f"{path}:/table"
    else:
        zarr.create_array(store=str(path), shape=rows.shape, chunks=(2500, rows.shape[1]), dtype=rows.dtype)[:] = rows
    return str(path)


def as_files(path):
    if path.is_dir():
        return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}
    return path.read_bytes()


def launchers():
    return {"mpirun": ([MPIRUN, "-n", 3, PY], clean_env(SPMD_BACKEND="mpi")),
            "spmd-run": ([tool("spmd"), "run", "-n", 3], clean_env())}


@pytest.mark.launcher
@pytest.mark.timeout(400)
@pytest.mark.parametrize("launcher", ["mpirun", "spmd-run"])
def test_three_ranks_read_and_write_every_format_in_parallel_under_every_balance(tmp_path, launcher):
    rows = SyntheticTable(20_000, 6, seed=11).read(0, 20_000)
    cmd, env = launchers()[launcher]
    job = REPO / "jobs" / "scatter_gather.py"
    balances = ("speed", "memory", "even") if launcher == "mpirun" else ("even", "speed", "memory")
    for fmt, balance in zip(FORMATS, balances):
        given = write_input(tmp_path / f"in.{fmt}", rows)
        serial, par = tmp_path / f"serial.{fmt}", tmp_path / f"par.{fmt}"
        args = ["--input", given, "--task", "mlp", "--chunk-rows", 3000,
                *{"parquet": ["--row-group-rows", 5000], "zarr": ["--zarr-chunk-rows", 1000]}.get(fmt, [])]
        done = run([PY, job, *args, "--output", serial, "--quiet"], 120, env=clean_env())
        assert done.returncode == 0, done.stdout[-3000:]
        done = run([*cmd, job, *args, "--output", par, "--balance", balance], 200, env=env)
        assert done.returncode == 0, done.stdout[-3000:]
        assert "3 ranks" in done.stdout and "read parallel" in done.stdout, done.stdout[-3000:]
        write = "write root" if fmt == "parquet" else "write parallel"  # h5 at offsets, zarr by chunk owners
        assert write in done.stdout, (fmt, done.stdout[-3000:])
        if fmt == "zarr":
            assert zarr.open_array(str(par), mode="r").chunks == (1000, 8)
            assert "shares and rounds end on the output's Zarr chunks of 1000 rows" in done.stdout
        if fmt == "parquet":
            assert [g.num_rows for g in map(pq.ParquetFile(par).metadata.row_group, range(4))] == [5000] * 4
        assert as_files(par) == as_files(serial), f"{fmt}, balance {balance}: the files differ"
        got = open_source(f"{par}:/data" if fmt == "h5" else par).read(0, 20_000)
        assert got.shape[0] == 20_000 and np.isfinite(got).all()


@pytest.mark.launcher
@pytest.mark.timeout(400)
@pytest.mark.parametrize("launcher", ["mpirun", "spmd-run"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_a_run_of_each_format_killed_halfway_resumes_at_another_size_with_the_same_bytes(tmp_path, launcher, fmt):
    given = write_input(tmp_path / f"in.{fmt}", SyntheticTable(ROWS, 4, seed=7).read(0, ROWS))
    out = tmp_path / f"out.{fmt}"
    whole = tmp_path / f"whole.{fmt}"
    pipeline(lambda b: b * np.float32(2), open_source(given), output=str(whole), chunk_rows=CHUNK)
    script = [WORLDS / "resumable.py", out, ROWS, CHUNK, 0.05, given]
    first, second, env = two_sizes(launcher)
    kill_halfway(first + script, env, out, f"{launcher} {fmt}, first run")
    result = run(second + script, 120, env=env)
    assert result.returncode == 0, result.stdout[-4000:]
    m = re.search(r"RESUMED (\d+) ROUNDS (\d+) PROCESSED (\d+) READ (\d+) MODE parallel/", result.stdout)
    assert m, result.stdout[-3000:]
    resumed, _, processed, read = (int(g) for g in m.groups())
    assert resumed >= ROWS // 2 and processed == ROWS - resumed and read == ROWS - resumed, result.stdout[-2000:]
    got = open_source(f"{out}:/data" if fmt == "h5" else out).read(0, ROWS)
    assert np.array_equal(got, reference())
    assert as_files(out) == as_files(whole)  # the bytes of an uninterrupted serial run
    assert not partial_path(out).exists() and not os.path.exists(journal.journal_path(out))
