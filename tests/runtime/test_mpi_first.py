"""spmd.init where a script started MPI itself on some ranks only (tests/worlds/mpi_first.py).

Every rank takes the same collective steps in init whoever called MPI_Init:
a rank that imported mpi4py.MPI first once skipped the barrier that releases
MPICH's /dev/shm segment while its peers waited in it, and the job hung.
"""

import json
import re

import pytest

from tests.support import MPIRUN, PY, WORLDS, clean_env, finish, start

pytestmark = pytest.mark.launcher


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", ["gloo", "mpi"])
def test_a_rank_that_started_mpi_itself_meets_one_that_did_not(backend):
    proc = start([MPIRUN, "-n", "2", PY, WORLDS / "mpi_first.py"], clean_env(SPMD_BACKEND=backend, SPMD_TIMEOUT=30))
    out = finish(proc, 90, f"mpi_first.py on {backend}").stdout
    assert proc.returncode == 0, out[-3000:]
    seen = {int(r): json.loads(text) for r, text in re.findall(r"SEGMENTS (\d+) (\{.*\})", out)}
    assert sorted(seen) == [0, 1], out[-3000:]
    for rank, got in seen.items():
        assert got["sum"] == [1.0, 3.0, 5.0], (rank, out[-3000:])
        assert got["named"] == [], f"rank {rank} still maps a named MPICH segment: {got['named']}"
