"""What the ranks of a block said, merged (spmd.interactive.merge), and the REPL's rank lists."""

import random

import pytest

from spmd.errors import SessionError
from spmd.interactive.merge import merged, render, where_report
from spmd.interactive.console import parse_ranks
from spmd.util.words import span

pytestmark = pytest.mark.unit


def test_parse_ranks_reads_back_the_span_every_label_is_written_with():
    rng = random.Random(3)
    for _ in range(300):
        size = rng.randint(1, 40)
        ranks = sorted(rng.sample(range(size), rng.randint(1, size)))
        assert parse_ranks(span(ranks), size) == ranks
    assert parse_ranks("all", 4) is None


@pytest.mark.parametrize("text, why", [("4", "ranks 0-3"), ("x", "0, 0,2, 1-3 or all"), ("1-", "0, 0,2"),
                                       ("-1", "1-3 or all"), ("2-1", "ranks 0-3")])
def test_a_bad_rank_list_names_the_world_or_the_syntax(text, why):
    with pytest.raises(SessionError, match=why.replace("(", r"\(")):
        parse_ranks(text, 4)


def test_identical_lines_once_with_their_ranks_different_ones_in_rank_order():
    said = {r: f"x = {r}\ndone\n" for r in range(4)}
    assert merged(said) == ["[0] x = 0", "[1] x = 1", "[2] x = 2", "[3] x = 3", "[0-3] done"]
    assert merged({r: "10.0\n" for r in range(4)}) == ["[0-3] 10.0"]
    same_two = {0: "a\n", 1: "b\n", 2: "a\n", 3: "b\n"}
    assert merged(same_two) == ["[0,2] a", "[1,3] b"]


def test_outputs_of_different_lengths_are_shown_whole_per_distinct_text_and_silent_ranks_not_at_all():
    said = {0: "one\n", 1: "one\ntwo\n", 2: "", 3: "one\n"}
    assert merged(said) == ["[0,3] one", "[1] one", "[1] two"]
    assert merged({0: "", 1: ""}) == []


def test_a_reply_shows_output_then_values_then_each_distinct_traceback_once_then_notes():
    boom = "Traceback (most recent call last):\n  File \"<spmd-1>\", line 1\nValueError: boom\n"
    reply = {"results": {0: {"out": "hi\n", "value": "1", "error": None},
                         1: {"out": "hi\n", "value": None, "error": boom},
                         2: {"out": "hi\n", "value": None, "error": boom}},
             "notes": ["spmd: a note"]}
    assert render(reply).split("\n") == [
        "[0-2] hi", "[0] 1", "[1-2] Traceback (most recent call last):", '[1-2]   File "<spmd-1>", line 1',
        "[1-2] ValueError: boom", "spmd: a note", ""]
    assert render({"results": {}}) == ""


def test_where_report_names_each_place_once_and_who_finished():
    said = {0: {"call": "barrier #3", "where": "<spmd-4>:1", "func": "<module>", "stack": "  File x\n"},
            1: {"call": "barrier #3", "where": "<spmd-4>:1", "func": "<module>", "stack": "  File x\n"},
            3: {"call": None, "where": "<spmd-4>:2", "func": "<module>", "stack": "  File y\n"}}
    text = where_report(said, [0, 1, 3, 4], [2], "the block did not finish within its timeout of 5 s")
    assert text.split("\n")[:5] == [
        "spmd: the block did not finish within its timeout of 5 s; where the ranks are:",
        "  ranks 0-1: waiting in barrier #3 at <spmd-4>:1",
        "  rank 3: at <spmd-4>:2 in <module>()",
        "  rank 4: did not answer (busy in C code, without the GIL released?)",
        "  rank 2: finished"]
    assert text.count("where ranks 0-1 stood") == 1 and text.count("where rank 3 stood") == 1
