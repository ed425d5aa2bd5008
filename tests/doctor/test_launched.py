"""spmd doctor on one host under each real launcher: one report from rank 0, every collective run, status 0."""

import json
import re

import pytest

from spmd.doctor.collectives import NAMES
from tests.support import BIN, MPIRUN, PY, clean_env, run, tool

pytestmark = pytest.mark.launcher


def report_of(result):
    """The one JSON object rank 0 printed (spmd run tags its lines '[0] ')."""
    text = re.sub(r"(?m)^\[0\] ", "", result.stdout)
    start = text.index("{\n")
    return json.loads(text[start:text.rindex("\n}") + 2])


def assert_healthy(result, ranks, backend):
    assert result.returncode == 0, result.stdout[-4000:]
    assert result.stdout.count('"hosts"') == 1, result.stdout[-4000:]  # rank 0 alone reports
    got = report_of(result)
    assert got["ok"] and got["ranks"] == ranks and len(got["hosts"]) == 1 and got["pairs"] == []
    assert sorted(got["hosts"][0]["ranks"]) == list(range(ranks))
    assert tuple(c["name"] for c in got["collectives"]) == NAMES  # one of every public collective
    assert all(c["ok"] and c["backend"] == backend for c in got["collectives"]), got["collectives"]
    versions = got["hosts"][0]["versions"]
    assert versions["spmd"] and versions["python"] and versions["torch"] and versions["mpi4py"]
    # under every launcher, MPI started or not (spmd run and torchrun never start it): the library answers
    assert versions["mpi"].startswith(("MPICH Version:", "Open MPI v")), versions


def test_under_mpirun_the_ranks_meet_through_hydra_before_mpi_starts():
    assert_healthy(run([MPIRUN, "-n", 3, PY, "-m", "spmd.doctor", "--json"], 120), 3, "mpi")


def test_under_spmd_run_as_the_console_script():
    assert_healthy(run([BIN / "spmd", "run", "-n", 2, BIN / "spmd", "doctor", "--json"], 120), 2, "gloo")


def test_under_torchrun():
    result = run([tool("torchrun"), "--nproc-per-node", 2, "-m", "spmd.doctor", "--json"], 150)
    assert_healthy(result, 2, "gloo")


def test_spmd_preflight_checks_pairs_before_mpi_init_and_the_job_runs():
    env = clean_env(SPMD_PREFLIGHT="1", SPMD_BACKEND="mpi")
    result = run([MPIRUN, "-n", 2, PY, "-c", "from spmd import comm; import numpy as np; "
                  "print('SUM', comm.all_reduce(np.ones(1))[0])"], 120, env)
    assert result.returncode == 0 and result.stdout.count("SUM 2.0") == 2, result.stdout[-3000:]
