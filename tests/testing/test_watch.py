"""Faults fail one test, never the session (spmd.testing.watch): deaths, hangs, a raise while the others wait."""

import pytest

from tests.testing.runs import pytest_in, user_dir

pytestmark = pytest.mark.launcher


def test_each_fault_fails_its_test_alone_naming_the_rank_and_the_next_runs_on_fresh_ranks(tmp_path):
    where = user_dir(tmp_path, "faults")
    result, cases, left = pytest_in(where, "-v", timeout=300)
    out = result.stdout
    outcomes = {name: outcome for name, (outcome, _, _) in cases.items()}
    assert outcomes == {
        "test_deadlock": "failed", "test_healthy_after_deadlock": "passed",
        "test_segfault": "failed", "test_exit_status": "failed", "test_sigkill": "failed",
        "test_raise_while_the_others_wait": "failed", "test_python_loop_past_the_timeout": "failed",
        "test_leaves_a_message_and_a_file": "passed", "test_sees_neither": "passed",
    }, out[-4000:]
    message = {name: m for name, (_, m, _) in cases.items()}
    # a deadlock: spmd's collective timeout on the ranks that wait, naming the call
    assert "all_reduce (call #1) timed out after 3 s" in out or "recv from rank 0" in out, out[-4000:]
    # deaths, named with their signal or status
    assert message["test_segfault"] == "rank 2 killed by signal SIGSEGV during the call"
    assert "Fatal Python error: Segmentation fault" in out and 'test_faults.py", line 29 in test_segfault' in out
    assert message["test_exit_status"] == "rank 1 exited with code 3 during the call"
    assert message["test_sigkill"] == "rank 0 killed by signal SIGKILL during the call"
    # a raise while the others wait in a collective: prompt, far before its timeout of 60 s
    assert message["test_raise_while_the_others_wait"].startswith("[rank 2] ValueError: boom on rank 2")
    assert cases["test_raise_while_the_others_wait"][2] < 30, cases["test_raise_while_the_others_wait"]
    assert "rank 0 was stopped during the call, waiting in all_reduce #1 at test_faults.py:51" in out
    # a rank that never returns to spmd: stopped at the timeout, where it stood
    assert ("rank 1 was stopped during the call, at test_faults.py:58 in test_python_loop_past_the_timeout(): "
            "the test did not finish within its timeout of 3 s") in out, out[-4000:]
    assert not left, f"processes of the session left behind: {left}"
