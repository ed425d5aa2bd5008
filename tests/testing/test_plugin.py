"""A user's multi-rank tests under plain pytest: the plugin forks each test's ranks (tests/testing/samples)."""

import pytest

from tests.testing.runs import pytest_in, user_dir

pytestmark = pytest.mark.launcher


def test_a_users_file_passes_and_fails_as_pytest_says_under_plain_pytest(tmp_path):
    where = user_dir(tmp_path, "user")
    result, cases, left = pytest_in(where, "-v", "--durations=3")
    out = result.stdout
    assert result.returncode == 1, out[-3000:]
    outcomes = {name: outcome for name, (outcome, _, _) in cases.items()}
    assert outcomes == {
        "test_numpy_and_torch": "passed",
        "test_tmp_path_is_one_directory[2 ranks]": "passed",
        "test_tmp_path_is_one_directory[3 ranks]": "passed",
        "test_odd_ranks_fail": "failed",
        "test_capsys": "passed",
        "test_xfail": "skipped",  # junit's word for an expected failure
        "test_skip_inside": "skipped",
        "test_six": "passed",
        "test_with_params[1]": "passed",
        "test_with_params[2]": "passed",
        "test_unmarked": "passed",
        "test_comm_without_marker": "error",
    }, out[-3000:]
    # pytest's own rewritten assertion, once for the ranks that failed alike, the others named
    assert cases["test_odd_ranks_fail"][1].startswith("[ranks 1, 3] assert 1 == 0"), cases["test_odd_ranks_fail"]
    assert "ranks 1, 3 of 4" in out and "ranks 0, 2 passed" in out and ">       assert value == 0" in out
    assert "Captured stdout call (rank 1)" in out and "rank 1 speaks" in out and "rank 3 speaks" in out
    assert "mark the test @pytest.mark.spmd(ranks=N)" in cases["test_comm_without_marker"][1]
    assert cases["test_skip_inside"][1] == "skipped on every rank"
    assert "test_plugin" not in out and out.count("short test summary info") == 1
    assert "PASSED test_user.py::test_tmp_path_is_one_directory[3 ranks]" in out
    assert "slowest 3 durations" in out and "test session starts" in out and out.count("test session starts") == 1
    assert not left, f"processes of the session left behind: {left}"


def test_k_x_and_last_failed_select_as_pytest_does(tmp_path):
    where = user_dir(tmp_path, "user")
    result, cases, _ = pytest_in(where, "-q", "-k", "odd or capsys or params")
    assert sorted(cases) == ["test_capsys", "test_odd_ranks_fail", "test_with_params[1]", "test_with_params[2]"]
    result, cases, _ = pytest_in(where, "-q", "-x", "-k", "odd or capsys or params")
    assert "stopping after 1 failures" in result.stdout and "test_with_params[1]" not in cases, result.stdout[-2000:]
    pytest_in(where, "-q", "-k", "odd or capsys")
    result, cases, _ = pytest_in(where, "-q", "--lf")
    assert list(cases) == ["test_odd_ranks_fail"], result.stdout[-2000:]


def test_a_marked_test_between_packages_leaves_this_sessions_setup_as_pytest_would(tmp_path):
    # unmarked a/, b/ (unmarked then marked), unmarked c/: package fixtures set up and torn down in order
    where = tmp_path / "user"
    for name, body in {"a/test_a.py": "def test_a():\n    pass\n",
                       "b/test_b0.py": "def test_b0():\n    pass\n",
                       "b/test_b1.py": "import pytest\n\n@pytest.mark.spmd(ranks=2)\ndef test_b1(comm):\n    pass\n",
                       "c/test_c.py": "def test_c():\n    pass\n"}.items():
        path = where / name
        path.parent.mkdir(parents=True, exist_ok=True)
        (path.parent / "__init__.py").write_text("")
        (path.parent / "conftest.py").write_text(
            "import pytest\n\n@pytest.fixture(scope='package', autouse=True)\ndef pkg():\n    yield\n")
        path.write_text(body)
    result, cases, _ = pytest_in(where, "-q")
    assert {n: o for n, (o, _, _) in cases.items()} == dict.fromkeys(["test_a", "test_b0", "test_b1", "test_c"],
                                                                      "passed"), result.stdout[-3000:]
