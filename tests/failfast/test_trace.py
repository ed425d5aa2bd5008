"""The merged trace: who the collectives waited for, found from durations alone, and the Chrome trace."""

import pytest

from spmd.failfast.trace import chrome_trace, format_waits, last_ranks, waits

pytestmark = pytest.mark.unit


def ev(name, seq, dur, **extra):
    return {"name": name, "seq": seq, "bytes": 8, "ts": 100.0 + seq, "dur": dur, **extra}


def four_ranks():
    """Four ranks on two hosts: rank 3 (on h2) comes last to calls 1 and 2, rank 0 (h1) to call 3."""
    return [
        [ev("all_reduce", 1, 0.50), ev("barrier", 2, 0.30), ev("broadcast", 3, 0.01)],
        [ev("all_reduce", 1, 0.45), ev("barrier", 2, 0.28), ev("broadcast", 3, 0.20)],
        [ev("all_reduce", 1, 0.40), ev("barrier", 2, 0.25), ev("broadcast", 3, 0.21)],
        [ev("all_reduce", 1, 0.05), ev("barrier", 2, 0.02), ev("broadcast", 3, 0.22)],
    ]


def test_the_rank_that_came_last_is_the_one_whose_call_was_shortest():
    lasts = last_ranks(four_ranks())
    assert lasts[1][0] == 3 and lasts[1][1] == pytest.approx(0.45 + 0.40 + 0.35)
    assert lasts[2][0] == 3 and lasts[3][0] == 0
    assert lasts[3][1] == pytest.approx(0.19 + 0.20 + 0.21)


def test_point_to_point_async_calls_splits_and_calls_not_every_rank_traced_are_left_out():
    per_rank = four_ranks()
    for rank, events in enumerate(per_rank):
        events += [ev("send", 4, 0.1 * rank, peer=0, tag=0), ev("all_reduce", 5, 0.1 * rank, sub=True),
                   ev("all_reduce", 6, 0.1 * rank, **{"async": True})]
        if rank:
            events.append(ev("gather", 7, 0.1))  # rank 0 never traced call 7
    assert set(last_ranks(per_rank)) == {1, 2, 3}
    assert last_ranks([[ev("barrier", 1, 0.2)]]) == {}  # a world of one waits for nobody


def test_the_host_waited_for_most_comes_first_with_its_ranks():
    rows = waits(four_ranks(), ["h1", "h1", "h2", "h2"])
    assert [r.where for r in rows] == ["h2 (ranks 2, 3)", "h1 (ranks 0, 1)"]
    assert rows[0].last == 2 and rows[0].calls == 3 and rows[0].waited == pytest.approx(1.2 + 0.77)
    text = format_waits(rows)
    assert text.startswith("spmd trace: the collectives waited most for h2 (ranks 2, 3): last to arrive in 2 of 3 calls")
    assert "then h1 (ranks 0, 1): last in 1" in text


def test_on_one_host_the_ranks_are_named_and_nothing_to_say_says_nothing():
    rows = waits(four_ranks(), ["h1"] * 4)
    assert [r.where for r in rows] == ["rank 3", "rank 0"]
    assert waits(four_ranks(), [None] * 4)[0].where == "rank 3"
    assert format_waits([]) == ""


def test_the_chrome_trace_names_each_process_by_host_and_each_collective_by_who_came_last():
    trace = chrome_trace(four_ranks(), ["h1", "h1", "h2", "h2"])["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in trace if e["ph"] == "M"}
    assert names == {0: "rank 0 (h1)", 1: "rank 1 (h1)", 2: "rank 2 (h2)", 3: "rank 3 (h2)"}
    spans = [e for e in trace if e["ph"] == "X"]
    assert {e["args"]["last_rank"] for e in spans if e["args"]["seq"] in (1, 2)} == {3}
    assert {e["args"]["last_rank"] for e in spans if e["args"]["seq"] == 3} == {0}
    assert chrome_trace(four_ranks())["traceEvents"][0]["args"]["name"] == "rank 0"
