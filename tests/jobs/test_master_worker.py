"""jobs/master_worker.py under mpirun (mpi and gloo), spmd run and plain python.

The expected total is computed here, independently of the job's code:
item i is the sum of squares of a rows x cols block of standard normals
from numpy.random.default_rng([seed, i]), and the total sums the items in
order, so it is the same float at every world size.
"""

import re

import numpy as np
import pytest

from tests.support import MPIRUN, PY, REPO, clean_env, run, tool

JOB = REPO / "jobs" / "master_worker.py"
ITEMS, ROWS, COLS, SEED = 60, 32, 16, 7
ARGS = ["--items", ITEMS, "--rows", ROWS, "--cols", COLS, "--seed", SEED]

pytestmark = pytest.mark.launcher
needs_mpirun = pytest.mark.skipif(MPIRUN is None, reason="mpirun not found: pip install mpich")

# The job takes about a second: a hang ends with spmd's timeout, which names the call, before the test's.
TIMEOUT = 60


def env(**extra):
    return clean_env(SPMD_TIMEOUT=TIMEOUT, **extra)


SUMMARY = re.compile(r"master_worker: (\d+) items, per worker \{([^}]*)\}, total (\S+), OK")


def expected_total(items=ITEMS, rows=ROWS, cols=COLS, seed=SEED):
    total = 0.0
    for i in range(items):
        block = np.random.default_rng([seed, i]).standard_normal((rows, cols))
        total += float(np.sum(block * block))
    return total


def summary(result, workers):
    """Check exit 0 and the OK line; return {worker: items handled}."""
    assert result.returncode == 0, f"exit {result.returncode}:\n{result.stdout[-4000:]}"
    found = SUMMARY.findall(result.stdout)
    assert len(found) == 1, f"expected one summary line:\n{result.stdout[-4000:]}"
    items, per_worker, total = found[0]
    counts = {int(w): int(c) for w, c in re.findall(r"(\d+): (\d+)", per_worker)}
    assert int(items) == ITEMS and sorted(counts) == workers and sum(counts.values()) == ITEMS, found[0]
    assert float(total) == pytest.approx(expected_total(), rel=1e-12), (total, expected_total())
    return counts


@pytest.mark.timeout(60)
def test_plain_python_computes_everything_on_one_rank():
    result = run([PY, JOB, *ARGS], 50, env())
    assert summary(result, [0]) == {0: ITEMS}


@pytest.mark.timeout(120)
@needs_mpirun
@pytest.mark.parametrize("backend", ["mpi", "gloo"])
def test_mpirun(backend):
    result = run([MPIRUN, "-n", 3, PY, JOB, *ARGS], 110, env(SPMD_BACKEND=backend))
    summary(result, [1, 2])


@pytest.mark.timeout(120)
def test_spmd_run():
    result = run([tool("spmd"), "run", "-n", 3, JOB, *ARGS], 110, env())
    summary(result, [1, 2])


@pytest.mark.timeout(120)
@needs_mpirun
@pytest.mark.parametrize("slow", [1, 2])
def test_the_slow_worker_gets_fewer_items(slow):
    # The slow rank sleeps 0.1 s per item; the other computes an item in well under that,
    # so asking on demand gives it most of the 60 items (about 55 on an idle machine).
    cmd = [MPIRUN, "-n", 3, PY, "-m", "spmd", JOB, *ARGS, "--slow-rank", slow, "--delay", 0.1]
    counts = summary(run(cmd, 110, env()), [1, 2])
    fast = 3 - slow
    assert counts[slow] < counts[fast], counts


@pytest.mark.timeout(60)
@needs_mpirun
def test_the_master_cannot_be_the_slow_rank():
    result = run([MPIRUN, "-n", 2, PY, JOB, *ARGS, "--slow-rank", 0], 50, env())
    assert result.returncode == 2 and "the workers are ranks 1 to 1" in result.stdout, result.stdout[-2000:]
