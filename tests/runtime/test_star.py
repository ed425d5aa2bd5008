"""The star over a store of threads: values between rank 0 and each rank, every wait bounded, silence named."""

import time

import pytest

from spmd.runtime.star import SoloStar, StarSilence
from tests.runtime.stars import ranks

pytestmark = pytest.mark.unit


def test_collect_then_share_round_trips_json():
    def body(star):
        got = star.collect({"rank": star.rank, "sq": star.rank ** 2}, 5)
        return star.share([g["sq"] for g in got] if got else None, 5)

    assert ranks(3, body) == [[0, 1, 4]] * 3


def test_a_silent_rank_is_none_once_and_not_waited_for_again():
    def body(star):
        if star.rank == 2:
            return "silent"
        first = star.collect(star.rank, 0.5)
        started = time.monotonic()
        second = star.collect(star.rank, 5)
        return first, second, time.monotonic() - started, sorted(star.gone)

    out = ranks(3, body)
    first, second, waited, gone = out[0]
    assert first == [0, 1, None] and second == [0, 1, None] and waited < 2 and gone == [2]


def test_a_rank_that_hears_nothing_raises_star_silence_in_time():
    def body(star):
        if star.rank == 0:
            return "gone"
        started = time.monotonic()
        try:
            star.share(None, 0.3)
        except StarSilence as exc:
            return str(exc), time.monotonic() - started

    text, waited = ranks(2, body)[1]
    assert "rank 1 heard nothing from rank 0 within 0.3 s" in text and waited < 2


def test_a_world_of_one_carries_nothing():
    star = SoloStar()
    assert star.collect(7, 1) == [7] and star.share("x", 1) == "x"
