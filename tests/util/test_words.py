"""spmd.util.words: ranks and exit statuses, said the same way by every report."""

import signal

import pytest

from spmd.util.words import exit_text, ranks_text, signal_name, span

pytestmark = pytest.mark.unit


def test_a_span_is_the_shortest_sorted_text_of_the_ranks():
    assert span([3, 0, 1, 2]) == "0-3"
    assert span([0, 2]) == "0,2"
    assert span([5, 0, 1, 2]) == "0-2,5"
    assert span([0, 2, 3]) == "0,2-3"
    assert span([4]) == "4" and span([]) == ""


def test_ranks_in_words_one_or_several_listed_or_as_ranges():
    assert ranks_text([2]) == "rank 2" and ranks_text([2], ranges=True) == "rank 2"
    assert ranks_text([3, 1]) == "ranks 1, 3"
    assert ranks_text([0, 2, 3]) == "ranks 0, 2, 3"
    assert ranks_text([3, 0, 1, 2], ranges=True) == "ranks 0-3"
    assert ranks_text([0, 2, 3], ranges=True) == "ranks 0,2-3"
    assert ranks_text(iter([1, 0])) == "ranks 0, 1"  # any iterable


def test_an_exit_status_in_words():
    assert exit_text(0) == "exited with code 0" and exit_text(3) == "exited with code 3"
    assert exit_text(-signal.SIGKILL) == "killed by signal SIGKILL"
    assert exit_text(-signal.SIGSEGV) == "killed by signal SIGSEGV"
    assert exit_text(-99) == "killed by signal 99"  # a number Python does not name, said once
    assert signal_name(signal.SIGTERM) == "SIGTERM" and signal_name(99) == "signal 99"
