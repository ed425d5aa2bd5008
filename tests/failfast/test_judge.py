"""The fail-fast hub's judge: who prints each error in full, and when the stacks report is complete.

No sockets, threads or clocks: the tests give the judge the times.
"""

import pytest

from spmd.failfast.hub.judge import REUSE, WINDOW, Gathering, Verdicts, death

pytestmark = pytest.mark.unit


def summary(rank, where="train.py:40", call="all_reduce #3"):
    return {"rank": rank, "host": "h", "pid": rank, "where": where, "func": "step", "call": call,
            "threads": "Thread MainThread:\n"}


def test_failures_in_the_window_are_answered_at_its_end_the_lowest_rank_first():
    v = Verdicts()
    assert v.deadline() is None
    assert v.failed(3, "aa", "w3", 10.0) == []
    assert v.failed(1, "aa", "w1", 10.1) == []
    assert v.failed(2, "bb", "w2", 10.2) == []
    assert v.deadline() == 10.0 + WINDOW
    assert v.due(10.0 + WINDOW - 0.01) == []
    assert v.due(10.0 + WINDOW) == [("w1", 1), ("w2", 2), ("w3", 1)]
    assert v.deadline() is None and v.due(11.0) == []


def test_after_the_window_a_failure_is_answered_at_once_with_the_lead_already_named():
    v = Verdicts()
    v.failed(2, "aa", "w2", 0.0)
    assert v.due(WINDOW) == [("w2", 2)]
    assert v.failed(0, "aa", "late", WINDOW + 1) == [("late", 2)]  # rank 2 printed it first
    assert v.failed(0, "cc", "other", WINDOW + 2) == [("other", 0)]  # a new error: its own report
    assert v.deadline() is None


def test_a_second_failure_of_one_rank_in_the_window_replaces_its_first():
    v = Verdicts()
    v.failed(1, "aa", "first", 0.0)
    v.failed(1, "bb", "second", 0.1)
    assert v.due(1.0) == [("second", 1)]


def test_a_death_names_the_rank():
    assert death(2, 4) == ("rank 2 of 4 died without reporting an error "
                           "(killed by a signal, or exited without finalize)")


def test_a_gathering_is_complete_once_every_rank_answered_and_answers_every_asker():
    g = Gathering(3)
    assert g.deadline is None and not g.complete() and not g.overdue(100.0)
    assert g.ask("w0", "a call timed out on rank 0", 1.0, 5.0, lambda: summary(0))
    assert g.deadline == 6.0
    assert not g.ask("w2", "ignored: one report at a time", 9.0, 5.1, lambda: pytest.fail("asked twice"))
    g.answered(1, summary(1, "train.py:77", None))
    assert not g.complete()
    g.answered(2, summary(2))
    assert g.complete()
    text, waiters = g.end(5.5)
    assert waiters == ["w0", "w2"]
    assert "where the 3 ranks are (a call timed out on rank 0)" in text
    assert "rank 1 is at train.py:77 in step()" in text
    assert g.deadline is None and not g.complete()


def test_a_gathering_past_its_wait_names_who_did_not_answer():
    g = Gathering(3)
    g.ask(None, "SIGUSR2 on rank 1", 2.0, 0.0, lambda: summary(0))
    g.answered(1, "not a dict")  # junk from a rank: not kept
    g.answered(2, {"where": "x" * 10**6, 7: "a key that is no string", "call": None})
    assert not g.complete() and not g.overdue(1.9) and g.overdue(2.0)
    text, _ = g.end(2.0)
    assert "rank 1 did not answer within 2 s" in text


def test_an_answer_with_no_gathering_in_progress_is_dropped():
    g = Gathering(2)
    g.answered(1, summary(1))
    g.ask("w", "SIGUSR2 on rank 0", 1.0, 0.0, lambda: summary(0))
    assert not g.complete()


def test_a_report_serves_the_timeouts_of_the_next_seconds_only():
    g = Gathering(1)
    assert g.reusable(True, 0.0) is None
    g.ask("w", "a call timed out on rank 0", 1.0, 0.0, lambda: summary(0))
    assert g.reusable(True, 0.5) is None  # one in progress: join it instead
    text, _ = g.end(1.0)
    assert g.reusable(True, 1.0 + REUSE - 0.01) == text
    assert g.reusable(False, 2.0) is None  # a signal asks for a fresh one
    assert g.reusable(True, 1.0 + REUSE) is None
