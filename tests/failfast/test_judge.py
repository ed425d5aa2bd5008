"""The fail-fast hub's judge: who prints each error in full, and when the stacks report is complete.

No sockets, threads or clocks: the tests give the judge the times.
"""

import pytest

from spmd.failfast.hub.judge import MISSES, REUSE, WINDOW, Gathering, Silence, Verdicts, death, silence

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


def test_deaths_and_silences_on_other_hosts_name_the_host_and_its_ranks():
    hosts = {0: "h1", 1: "h1", 2: "h2", 3: "h2", 4: "h3"}
    assert death(1, 5, hosts, "h1").startswith("rank 1 of 5 died")  # rank 0's own host: as on one host
    assert death([3, 2], 5, hosts, "h1").startswith("ranks 2, 3 of 5 on h2 died without reporting an error")
    assert silence({2: 10.4, 3: 9.2}, hosts).startswith("no word from h2 (ranks 2, 3) for 10 s (no heartbeat")
    assert silence({4: 6.0, 2: 7.0}, hosts).startswith("no word from h2 (rank 2) and h3 (rank 4) for 7 s")
    assert silence({7: 6.0}).startswith("no word from rank 7 for 6 s")  # a host not known


def test_a_silence_of_every_other_host_points_at_rank_0s_own_host():
    hosts = {0: "h1", 1: "h2", 2: "h3", 3: "h3"}
    alone = silence({1: 5.2, 2: 5.1, 3: 5.0}, hosts, "h1", 4)
    assert alone.startswith("no word from h2 (rank 1) and h3 (ranks 2, 3) for 5 s (no heartbeat")
    assert alone.endswith(": every other host fell silent at once, so h1 itself (rank 0's host) may be cut off")
    assert "h1 itself" not in silence({2: 5.1, 3: 5.0}, hosts, "h1", 4)  # h2 still heard: h3 is the silent one
    two = {0: "h1", 1: "h1", 2: "h2", 3: "h2"}
    assert "itself" not in silence({2: 5.0, 3: 5.0}, two, "h1", 4)  # one other host: either side may be cut off
    assert "itself" not in silence({1: 5.0, 2: 5.0}, {}, None, 3)  # no hosts known


def test_silence_is_declared_after_misses_beats_with_every_rank_that_missed_one():
    s = Silence(2.0)
    assert s.limit == 2.0 * MISSES and s.deadline() is None
    s.heard(1, 0.0)
    s.heard(2, 0.0)
    s.heard(3, 0.0)
    for now in (1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0):  # looked at every second
        s.heard(3, now)
        s.heard(2, min(now, 6.0))  # rank 2 stops at 6 s
        assert s.silent(now) == {}
    assert s.deadline() == 10.0
    assert s.silent(10.0) == {1: 10.0, 2: 4.0}  # rank 2 missed a beat too; rank 3 did not
    s.forget(1)
    assert s.silent(10.0) == {}


def test_time_the_judging_side_was_away_does_not_count():
    s = Silence(2.0)
    s.heard(1, 0.0)
    assert s.silent(1.0) == {}
    assert s.silent(61.0) == {}  # this side was stopped for a minute: rank 1 is not blamed for it
    assert all(s.silent(now) == {} for now in range(62, 68))  # 10 s of silence counted from 58 s
    assert s.silent(68.0) == {1: 10.0}  # and is, once it stays silent while this side looks


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
