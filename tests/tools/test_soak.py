"""The soak (tests/tools/soak.py) in small: 15 jobs, every kind under every launcher once, two pairs.

Every job as promised, and nothing left: no process, port, unix socket, temporary file or
/dev/shm segment (MPICH's, which a job that did not end in MPI_Finalize left behind until
spmd.runtime.mpishm unlinked it once every rank had it mapped).
"""

import subprocess
import time

import pytest

from tests.support import MPIRUN, PY, REPO, clean_env, missing
from tests.tools import soak

pytestmark = [pytest.mark.launcher]

JOBS, SEED = 15, 7


@pytest.fixture(scope="module")
def soaked(tmp_path_factory):
    if MPIRUN is None:
        missing("mpirun not found: pip install mpich")
    path = tmp_path_factory.mktemp("soak") / "table.md"
    began = time.monotonic()
    run = subprocess.run([PY, REPO / "tests" / "tools" / "soak.py", "--jobs", str(JOBS), "--seed", str(SEED),
                          "--table", path], env=clean_env(), cwd=REPO, capture_output=True, text=True, timeout=380)
    rows = soak.read_table(path.read_text()) if path.exists() else []
    return run, rows, time.monotonic() - began


@pytest.mark.timeout(400)
def test_a_soak_of_15_jobs_keeps_every_promise_and_leaves_nothing_behind(soaked):
    run, rows, _ = soaked
    out = run.stdout[-6000:] + run.stderr[-3000:]
    assert rows, f"no table (exit {run.returncode}):\n{out}"
    jobs = [r for r in rows if not r["kind"].startswith("**")]
    assert {(r["kind"], r["launcher/backend"]) for r in jobs} == {(k, l) for k in soak.KINDS for l in soak.LAUNCHERS}
    every, remaining = rows[-2], rows[-1]
    assert every["jobs"] == str(JOBS) and int(every["in pairs"]) > 0, out
    assert every["unexpected"] == "0", out
    for category in soak.CATEGORIES:
        assert remaining[category] == "0", (category, out)  # what the launcher left is removed too
        if category not in soak.LAUNCHERS_OWN:
            assert every[category] == "0", (category, out)
    # MPICH's mpiexec leaves its topology file after a job that ends in MPI_Abort (a raise): counted
    aborted = [r for r in jobs if r["kind"] == "raise" and r["launcher/backend"].startswith("mpirun")]
    assert sum(int(r["mpirun files"]) for r in aborted) >= sum(int(r["jobs"]) for r in aborted) > 0, out
    assert run.returncode == 0, out
