"""Waves of tests on disjoint ranks under a launcher (spmd.testing.schedule)."""

import random

import pytest

from spmd.errors import MarkerError
from spmd.testing.schedule import too_big, waves

pytestmark = pytest.mark.unit


def test_every_test_that_fits_runs_once_on_disjoint_ranks_of_the_world():
    rng = random.Random(7)
    for world in (1, 2, 3, 4, 8):
        sizes = [rng.choice([1, 1, 2, 3, 4, 8, 9]) for _ in range(60)]
        plan = waves(sizes, world)
        placed = [slot.index for wave in plan for slot in wave]
        assert sorted(placed) == [i for i, n in enumerate(sizes) if n <= world]
        assert sorted(too_big(sizes, world)) == [i for i, n in enumerate(sizes) if n > world]
        for wave in plan:
            ranks = [r for slot in wave for r in slot.ranks]
            assert len(ranks) == len(set(ranks)) and all(0 <= r < world for r in ranks)
            assert all(len(slot.ranks) == sizes[slot.index] for slot in wave)


def test_small_tests_fill_the_ranks_a_large_one_leaves_first_fit_in_order():
    plan = waves([4, 2, 2, 1, 1, 3, 1], 4)
    assert [[(s.index, s.ranks) for s in wave] for wave in plan] == [
        [(0, (0, 1, 2, 3))],
        [(1, (0, 1)), (2, (2, 3))],
        [(3, (0,)), (4, (1,)), (6, (2,))],
        [(5, (0, 1, 2))],
    ]


def test_a_world_of_none_is_refused():
    with pytest.raises(MarkerError):
        waves([1], 0)
