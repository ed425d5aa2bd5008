"""spmd.pipeline.balance: splitting a round by weights and caps, the Planner, memory budgets."""

import numpy as np
import pytest

from spmd.errors import PipelineValueError
from spmd.pipeline import balance


@pytest.mark.unit
def test_split_follows_weights_within_caps():
    assert balance.split(10, [1, 1, 1]) == [4, 3, 3]
    assert balance.split(10, [2, 1, 1]) == [5, 3, 2]
    assert balance.split(10, [1, 1, 1], caps=[1, 100, 100]) == [1, 5, 4]
    assert balance.split(10, [1, 1], caps=[2, 3]) == [2, 3]  # the caps hold less than the round
    assert balance.split(0, [1, 1]) == [0, 0]
    rng = np.random.default_rng(1)
    for _ in range(300):
        n, size = int(rng.integers(0, 1000)), int(rng.integers(1, 9))
        weights = list(rng.uniform(0, 5, size))
        caps = list(rng.integers(0, 400, size))
        got = balance.split(n, weights, caps)
        assert sum(got) == min(n, sum(caps)) and all(0 <= g <= c for g, c in zip(got, caps)), (n, weights, caps)


@pytest.mark.unit
def test_planner_speed_shares_follow_measured_rates_and_memory_caps_rows():
    p = balance.Planner("speed", 2, 900, 64)
    assert p.plan(10_000) == p.plan(10_000) == [113, 112]  # nothing measured yet: even, and small
    p.observe([450, 450], [1.0, 2.0])  # rank 1 is half as fast
    assert p.plan(10_000) == [600, 300]
    p.observe([0, 0], [0.0, 0.0])  # a round without rows changes nothing
    assert p.plan(10_000) == [600, 300]
    assert p.plan(100) == [67, 33]  # the last, short round
    m = balance.Planner("memory", 3, 1000, 100, budgets=[10**9, 10**9, 4000])
    assert m.plan(10**6) == [495, 495, 10]  # 4000 // (2 rounds * (100 in + 100 out, until measured))
    m.observe([490, 490, 20], [1, 1, 1], out_row_bytes=900)
    assert m.plan(10**6)[2] == 2  # 4000 // (2 * (100 + 900)): the output rows turned out larger
    with pytest.raises(PipelineValueError, match="no rank has memory for one row"):
        balance.Planner("memory", 2, 10, 100, budgets=[10, 10]).plan(10)
    with pytest.raises(PipelineValueError, match="balance='fast'"):
        balance.Planner("fast", 2, 10, 1)


@pytest.mark.unit
def test_memory_budgets_parse_per_rank():
    assert balance.parse_budget("512M") == 512 << 20
    assert [balance.parse_budget("2G,512k,1000", r) for r in range(4)] == [2 << 30, 512 << 10, 1000, 1000]
    assert balance.parse_budget(4096, 3) == 4096 and balance.parse_budget("1.5GiB") == 3 << 29
    for bad in ("lots", "-1M", "0", ""):
        with pytest.raises(PipelineValueError, match="memory budget"):
            balance.parse_budget(bad)
    assert balance.free_memory() > 0
