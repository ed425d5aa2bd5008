"""One pytest report of a phase, made from its ranks' reports (spmd.testing.merge)."""

from types import SimpleNamespace

import pytest
from _pytest._code import ExceptionInfo
from _pytest.reports import TestReport

from spmd.testing.merge import merge

pytestmark = pytest.mark.unit

ITEM = SimpleNamespace(nodeid="test_u.py::test_x", location=("test_u.py", 9, "test_x"), keywords={"test_x": 1})


def _failed(message, rank_out=""):
    try:
        raise AssertionError(message)
    except AssertionError as e:
        longrepr = ExceptionInfo.from_exception(e).getrepr()
    return TestReport(ITEM.nodeid, ITEM.location, {}, "failed", longrepr, "call",
                      sections=[("Captured stdout call", rank_out)] if rank_out else [], duration=0.5)


def _passed(out="", duration=0.25):
    return TestReport(ITEM.nodeid, ITEM.location, {}, "passed", None, "call",
                      sections=[("Captured stdout call", out)] if out else [], duration=duration)


def test_ranks_that_fail_alike_are_one_failure_and_the_passing_ranks_are_named():
    per_rank = {0: _passed("same\n"), 1: _failed("rank 1 saw 3", "one\n"), 2: _passed("same\n"),
                3: _failed("rank 3 saw 3", "three\n")}
    rep = merge(ITEM, "call", 4, per_rank, {})
    text = str(rep.longrepr)
    assert rep.failed and rep.when == "call" and rep.duration == 0.5
    assert "rank 1 saw 3" in text and "rank 3 saw 3" not in text  # the lowest rank's, once
    assert "ranks 1, 3 of 4" in text and "ranks 0, 2 passed" in text
    assert rep.longrepr.reprcrash.message.startswith("[ranks 1, 3] AssertionError: rank 1 saw 3")
    assert dict(rep.sections) == {"Captured stdout call (ranks 0, 2)": "same\n",
                                  "Captured stdout call (rank 1)": "one\n",
                                  "Captured stdout call (rank 3)": "three\n"}


def test_failures_that_differ_are_shown_each_with_their_ranks():
    rep = merge(ITEM, "call", 3, {0: _failed("x is 0"), 1: _failed("x is 5"), 2: _failed("x is 5")}, {})
    text = str(rep.longrepr)
    assert "rank 0 of 3" in text and "ranks 1, 2 of 3" in text and "x is 0" in text and "x is 5" in text


def test_a_rank_that_died_leads_the_report_and_the_peers_errors_follow():
    endings = {2: "killed by signal SIGSEGV during the call",
               0: "was stopped during the call, waiting in all_reduce #3 at t.py:4: rank 2 failed"}
    rep = merge(ITEM, "call", 3, {1: _failed("peer lost")}, endings)
    text = str(rep.longrepr)
    assert rep.longrepr.reprcrash.message == "rank 2 killed by signal SIGSEGV during the call"
    assert text.index("rank 2 of 3 killed") < text.index("peer lost") < text.index("rank 0 was stopped")


def test_a_phase_every_rank_passed_is_one_passed_report_with_the_slowest_duration():
    rep = merge(ITEM, "call", 2, {0: _passed(duration=0.1), 1: _passed(duration=0.3)}, {})
    assert rep.passed and rep.duration == 0.3 and rep.longrepr is None


def test_passed_on_some_ranks_and_skipped_on_others_is_passed():
    skipped = TestReport(ITEM.nodeid, ITEM.location, {}, "skipped", ("test_u.py", 10, "Skipped: not here"), "call")
    rep = merge(ITEM, "call", 2, {0: skipped, 1: _passed()}, {})
    assert rep.passed

