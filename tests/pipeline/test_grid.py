"""spmd.pipeline.grid: a round's shares moved onto a chunked format's edges, and the planner that uses it."""

import random

import pytest

from spmd.pipeline.balance import Planner
from spmd.pipeline.grid import ANY_ROW, Grid

pytestmark = pytest.mark.unit


def _edges(shares, start):
    out, at = [], start
    for n in shares:
        at += n
        out.append(at)
    return out


@pytest.mark.parametrize("grid", [Grid.of(100), Grid.of(7), Grid.of(edges=[0, 64, 200, 201, 640, 999, 1000])])
def test_every_edge_falls_on_the_grid_and_no_row_is_lost_or_doubled(grid):
    rng = random.Random(4)
    on = (lambda e: e % grid.step == 0) if not grid.edges else (lambda e: e in grid.edges)
    for _ in range(500):
        size, end = rng.randint(1, 5), 1000
        start = rng.choice([0, 0, 100, 200, 640]) if grid.edges else rng.randrange(0, end // grid.step) * grid.step
        n = rng.randint(1, end - start)
        shares = [n // size + (r < n % size) for r in range(size)]
        got = grid.align(shares, start, end)
        assert len(got) == size and all(k >= 0 for k in got), (shares, start, got)
        stop = start + sum(got)
        assert start < stop <= end and (stop == end or on(stop)), (shares, start, got)
        for e in _edges(got, start)[:-1]:  # between ranks: an edge, or a share that is empty beside it
            assert on(e) or e in (start, stop), (shares, start, got)


def test_an_edge_moves_to_the_nearest_chunk_edge_and_a_round_to_whole_chunks():
    g = Grid.of(100)
    assert g.align([250, 250], 0, 1000) == [200, 300]  # a tie goes to the lower edge
    assert g.align([333, 333, 334], 0, 1000) == [300, 400, 300]
    assert g.align([30, 30], 0, 1000) == [0, 100]  # a round smaller than a chunk grows to one
    assert g.align([30, 30], 900, 960) == [0, 60]  # the data's last rows: a partial last chunk, one owner
    assert g.align([0, 0], 0, 1000) == [0, 0]
    assert ANY_ROW.align([3, 4], 5, 100) == [3, 4] and ANY_ROW.free and not g.free


def test_the_planner_keeps_its_balance_on_the_grid():
    grid = Grid.of(1000)
    p = Planner("even", 2, 4500, 64, grid=grid)
    start, rounds = 0, []
    while start < 20000:
        shares = p.plan(20000 - start, start)
        rounds.append(shares)
        start += sum(shares)
    assert start == 20000 and rounds[0] == [2000, 2000], rounds  # 4500 rows a round: 4000, on the grid
    assert all(sum(s) % 1000 == 0 for s in rounds) and all(s[0] % 1000 == 0 for s in rounds), rounds
    few = Planner("even", 3, 1000, 64, grid=grid)  # rounds of 1000 rows: one chunk; grown to one per rank
    assert few.plan(10000, 0) == [1000, 1000, 1000]
    assert few.plan(1500, 8500) == [500, 0, 1000]  # the last rows: 8500 to 9000 is the rest of a chunk
    fast = Planner("speed", 2, 8000, 64, grid=grid)
    assert fast.plan(20000, 0) == fast.plan(18000, 2000) == [1000, 1000]  # the probes: 8000 // 4 rows
    fast.observe([1000, 1000], [1.0, 3.0])  # rank 0 three times as fast
    assert fast.plan(16000, 4000) == [6000, 2000]
    capped = Planner("memory", 2, 8000, 64, budgets=[40 * 256 * 2 * 2, None], grid=grid)
    assert capped.plan(20000, 0)[0] in (0, 1000)  # a cap of 40 rows: the nearest edge, 0
