"""The jobs in jobs/, run as users run them: under mpirun, spmd run and plain python.

Worlds are few and small (1003 rows, which no world size here divides);
the outputs of the main job are compared byte for byte across world
sizes, backends, chunkings and input formats.
"""

import importlib.util
import re

import numpy as np
import pytest
from click.testing import CliRunner

from tests.support import MPIRUN, PY, REPO, clean_env, run, tool
from spmd.pipeline import checksum
from spmd.pipeline import tasks
from spmd.pipeline.run import SyntheticTable

JOBS = REPO / "jobs"
SPMD = tool("spmd")
ROWS = 1003

needs_mpirun = pytest.mark.skipif(MPIRUN is None, reason="mpirun not found")


def mpirun(n, script, *args, backend=None, timeout=200):  # below the tests' marks
    env = clean_env(**({"SPMD_BACKEND": backend} if backend else {}))
    return run([MPIRUN, "-n", n, PY, JOBS / script, *args], timeout=timeout, env=env)


def ok(result):
    assert result.returncode == 0, f"exit {result.returncode}:\n{result.stdout[-4000:]}"
    return result.stdout


# -- jobs/collectives.py -------------------------------------------------------------


def guide_lines(n):
    """The lines the guide's examples print at world size n."""
    total = float(n * (n + 1) // 2)
    ones = [float(k + 1) for k in range(n)]
    return (
        [f"Reduced result on rank 0: {total}"]
        + [f"Rank {r} result: {total}" for r in range(n)]
        + [f"Rank {r} after scatter: {float(r + 1)}" for r in range(n)]
        + [f"Gathered results: {[2 * v for v in ones]}"]
        + [f"Rank {r} got: {ones}" for r in range(n)]
        + [f"Rank {r} received: tensor([1, 2, 3])" for r in range(n)]
    )


def printed(out):
    """The guide's lines in out, in order (headings and blank lines left out)."""
    return [line for line in out.splitlines() if re.match(r"(Rank|Reduced|Gathered)", line)]


@pytest.mark.launcher
@needs_mpirun
@pytest.mark.timeout(300)
def test_collectives_print_the_guides_lines_under_mpirun_4():
    out = ok(mpirun(4, "collectives.py"))
    assert printed(out) == guide_lines(4)
    for line in ["Reduced result on rank 0: 10.0", "Rank 2 result: 10.0", "Rank 1 after scatter: 2.0",
                 "Gathered results: [2.0, 4.0, 6.0, 8.0]", "Rank 0 got: [1.0, 2.0, 3.0, 4.0]",
                 "Rank 1 received: tensor([1, 2, 3])"]:
        assert line in out.splitlines()
    assert "world size 4, backend mpi" in out


@pytest.mark.launcher
@pytest.mark.timeout(300)
def test_collectives_at_sizes_1_and_2():
    one = ok(run([PY, JOBS / "collectives.py"], timeout=120))
    assert printed(one) == guide_lines(1) and "world size 1, backend serial" in one
    two = ok(run([SPMD, "run", "-n", 2, "--no-prefix", JOBS / "collectives.py"], timeout=120))
    assert printed(two) == guide_lines(2) and "world size 2, backend gloo" in two


# -- jobs/scatter_gather.py -----------------------------------------------------------


@pytest.fixture(scope="module")
def job():
    """The job's click command, loaded in this process (a world of one)."""
    spec = importlib.util.spec_from_file_location("scatter_gather_job", JOBS / "scatter_gather.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """The default synthetic table of ROWS rows as .csv and as a directory of shards."""
    root = tmp_path_factory.mktemp("data")
    table = SyntheticTable(ROWS, 16, seed=0).read(0, ROWS)
    np.savetxt(root / "table.csv", table, delimiter=",", fmt="%.9g",
               header=",".join(f"x{i}" for i in range(16)), comments="")
    shards = root / "shards"
    shards.mkdir()
    for i, (a, b) in enumerate([(0, 400), (400, 401), (401, 1003)]):
        np.save(shards / f"part-{i}.npy", table[a:b])
    return root


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Outputs of both main tasks in a world of one, run as a plain script."""
    root = tmp_path_factory.mktemp("ref")
    out = ok(run([PY, JOBS / "scatter_gather.py", "--rows", ROWS, "--output", root / "mlp.npy", "--verify"],
                 timeout=120))
    assert "1 rank, backend serial" in out and "verify: serial recomputation identical" in out
    assert f"{ROWS} rows in, {ROWS} out (8 float32 each)" in out
    data = np.load(root / "mlp.npy")
    assert data.shape == (ROWS, 8) and data.dtype == np.float32 and np.isfinite(data).all()
    kind = checksum.get()
    assert f"checksum {kind.name} {kind.of(data):08x}" in out
    ok(run([PY, JOBS / "scatter_gather.py", "--rows", ROWS, "--task", "standardize", "--quiet",
            "--output", root / "standardize.npy"], timeout=120))
    return {name: (root / f"{name}.npy").read_bytes() for name in ("mlp", "standardize")}


def same_output(path, reference, task):
    assert path.read_bytes() == reference[task], f"{path.name} differs from the serial {task} output"


def summary_of(out, n, backend, rounds):
    assert f"{n} ranks, backend {backend}; {rounds} rounds" in out, out[-3000:]
    assert f"{ROWS} rows in, {ROWS} out" in out


@pytest.mark.launcher
@needs_mpirun
@pytest.mark.timeout(500)  # the module fixture's runs may count here too
def test_size_2_gloo_from_shards_matches_serial(reference, data, tmp_path):
    out = ok(mpirun(2, "scatter_gather.py", "--input", data / "shards", "--chunk-rows", 257,
                    "--output", tmp_path / "o.npy", backend="gloo"))
    summary_of(out, 2, "gloo", 4)
    same_output(tmp_path / "o.npy", reference, "mlp")


@pytest.mark.launcher
@needs_mpirun
@pytest.mark.timeout(500)
def test_size_4_mpi_standardize_chunked_and_verified(reference, tmp_path):
    out = ok(mpirun(4, "scatter_gather.py", "--rows", ROWS, "--task", "standardize", "--chunk-rows", 100,
                    "--verify", "--output", tmp_path / "o.npy", backend="mpi"))
    summary_of(out, 4, "mpi", 11)
    assert "verify: serial recomputation identical" in out
    same_output(tmp_path / "o.npy", reference, "standardize")


@pytest.mark.launcher
@needs_mpirun
@pytest.mark.timeout(500)
def test_size_4_from_csv_with_ranks_left_empty(reference, data, tmp_path):
    # rounds of 501, 501 and 1 rows: in the last, three of four ranks get nothing
    out = ok(mpirun(4, "scatter_gather.py", "--input", data / "table.csv", "--chunk-rows", 501,
                    "--output", tmp_path / "o.npy"))
    summary_of(out, 4, "mpi", 3)
    same_output(tmp_path / "o.npy", reference, "mlp")


@pytest.mark.launcher
@needs_mpirun
@pytest.mark.timeout(600)
def test_size_8_matches_serial_and_verifies(reference, tmp_path):
    out = ok(mpirun(8, "scatter_gather.py", "--rows", ROWS, "--chunk-rows", 300, "--verify",
                    "--output", tmp_path / "o.npy", timeout=500))
    summary_of(out, 8, "mpi", 4)
    assert "verify: serial recomputation identical" in out
    for phase in ("load", "scatter", "process", "gather", "write"):
        assert re.search(rf"\b{phase} \d+\.\d+", out), phase
    same_output(tmp_path / "o.npy", reference, "mlp")


@pytest.mark.launcher
@needs_mpirun
@pytest.mark.timeout(300)
def test_a_missing_input_fails_once_with_the_reason():
    result = mpirun(2, "scatter_gather.py", "--input", "/nonexistent/table.npy", "--task", "standardize")
    assert result.returncode != 0
    assert result.stdout.count("no such file or directory") == 1, result.stdout


@pytest.mark.launcher
def test_in_process_quiet_and_rows_with_input_is_refused(job, data, reference, tmp_path):
    runner = CliRunner()
    res = runner.invoke(job.main, ["--rows", ROWS, "--chunk-rows", 10, "--quiet", "--output", tmp_path / "o.npy"])
    assert res.exit_code == 0 and res.output == "", res.output
    same_output(tmp_path / "o.npy", reference, "mlp")
    res = runner.invoke(job.main, ["--rows", 5, "--input", data / "table.csv"])
    assert res.exit_code == 2 and "cannot be used with --input" in res.output


@pytest.mark.unit
def test_verification_failure_exits_non_zero(job, monkeypatch):
    calls = []

    def drifting(features, seed, stats):
        def fn(block):
            calls.append(1)
            return block + len(calls)

        return fn

    monkeypatch.setitem(tasks.TASKS, "mlp", tasks.Task("mlp", drifting))
    res = CliRunner().invoke(job.main, ["--rows", 50, "--verify"])
    assert res.exit_code == 1, res.output
    assert "verify: FAILED, 50 rows differ" in res.output
    assert "verification failed: 50 of 50 rows differ" in res.output
