"""mpi4py's tutorial, ported to spmd (tests/worlds/mpi4py_tutorial.py), under real launchers.

Each rank of the world checks its results against values computed from
rank and size and prints ``TUTORIAL OK rank <r> size <n> backend <b>
checks <k>``; here every rank's line must be there, with the backend
expected, and the job must exit 0.
"""

import re

import pytest

from tests.support import MPIRUN, PY, WORLDS, clean_env, run, tool

TUTORIAL = WORLDS / "mpi4py_tutorial.py"
# The tutorial takes seconds: a hang ends with spmd's timeout, which names the call, well before the test's.
TIMEOUT = 60


def env(**extra):
    return clean_env(SPMD_TIMEOUT=TIMEOUT, **extra)

pytestmark = [pytest.mark.launcher, pytest.mark.skipif(MPIRUN is None, reason="mpirun not found: pip install mpich")]

# Hydra forwards each rank's output in chunks, so one rank's line may run into the next one's.
LINE = re.compile(r"TUTORIAL OK rank (\d+) size (\d+) backend ([a-z]+) checks (\d+)")


def assert_tutorial(result, size, backend):
    """Assert the job exited 0 and every rank printed its line, with this size and backend."""
    got = {int(m[1]): (int(m[2]), m[3], int(m[4])) for m in LINE.finditer(result.stdout)}
    assert result.returncode == 0 and sorted(got) == list(range(size)), (
        f"exit {result.returncode}, ranks reporting {sorted(got)} of {size}:\n{result.stdout[-4000:]}"
    )
    for rank, (n, b, checks) in got.items():
        assert (n, b) == (size, backend), (rank, n, b)
        assert checks >= 30, (rank, checks)  # every section ran
    return got


@pytest.mark.timeout(150)
@pytest.mark.parametrize("size", [2, 4])
def test_mpirun_mpi(size):
    result = run([MPIRUN, "-n", size, PY, "-m", "spmd", TUTORIAL], 140, env())
    assert_tutorial(result, size, "mpi")


@pytest.mark.timeout(150)
def test_mpirun_gloo():
    result = run([MPIRUN, "-n", 3, PY, "-m", "spmd", TUTORIAL], 140, env(SPMD_BACKEND="gloo"))
    assert_tutorial(result, 3, "gloo")


@pytest.mark.timeout(150)
def test_spmd_run():
    result = run([tool("spmd"), "run", "-n", 3, TUTORIAL], 140, env())
    assert_tutorial(result, 3, "gloo")


@pytest.mark.timeout(150)
def test_torchrun():
    result = run([tool("torchrun"), "--nproc-per-node", 2, "-m", "spmd", TUTORIAL], 140, env())
    assert_tutorial(result, 2, "gloo")


@pytest.mark.timeout(60)
def test_one_rank_is_refused():
    # The tutorial's examples need a peer: with one rank it says so and exits non-zero.
    result = run([PY, TUTORIAL], 50, env())
    assert result.returncode != 0 and "needs at least 2 ranks" in result.stdout, result.stdout[-2000:]
