"""A user's multi-rank tests under a launcher: the world's ranks run them on sub-communicators, rank 0 reports."""

import pytest

from tests.support import MPIRUN, PY, missing, tool
from tests.testing.runs import UNDER_A_WORLD_OF_4, pytest_in, user_dir

pytestmark = pytest.mark.launcher



@pytest.mark.parametrize("launcher", ["mpirun", "spmd run"])
def test_a_users_file_under_a_launcher_runs_each_test_once_and_reports_once(tmp_path, launcher):
    if launcher == "mpirun" and MPIRUN is None:
        missing("MPICH's mpirun (bin/setup installs it)")
    prefix, python = ([MPIRUN, "-n", "4"], [PY]) if launcher == "mpirun" else ([tool("spmd"), "run", "-n", "4"], [])
    where = user_dir(tmp_path, "user")
    result, cases, left = pytest_in(where, "-v", launcher=prefix, python=python)
    out = result.stdout
    assert result.returncode != 0 and {n: o for n, (o, _, _) in cases.items()} == UNDER_A_WORLD_OF_4, out[-4000:]
    assert cases["test_six"][1] == "needs 6 ranks; the world has 4 (launch at least 6)"
    assert cases["test_odd_ranks_fail"][1].startswith("[ranks 1, 3] assert 1 == 0"), cases["test_odd_ranks_fail"]
    assert "ranks 0, 2 passed" in out and "rank 3 speaks" in out
    # one report, by rank 0: one header, one summary, one line per test
    assert out.count("test session starts") == 1 and out.count("short test summary info") == 1, out[-4000:]
    assert out.count("test_user.py::test_capsys PASSED") == 1
    assert not left, f"processes of the session left behind: {left}"
