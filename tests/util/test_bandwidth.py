"""One busbw table: spmd bench and SPMD_TRACE's summary agree for every collective."""

import pytest

from spmd.bench.cases import ALL, BUSBW
from spmd.failfast.trace import summarize
from spmd.util.bandwidth import bus_factor

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("n", [2, 3, 8])
def test_the_trace_reports_the_busbw_the_bench_does(n):
    for name in ("all_reduce", "all_gather", "gather", "scatter", "broadcast", "reduce",
                 "all_to_all", "reduce_scatter", "scan", "exscan", "sendrecv"):
        (row,) = summarize([{"name": name, "bytes": 1000, "dur": 1e-3}], n)
        algbw, busbw = row[4], row[5]
        assert busbw == pytest.approx(algbw * BUSBW(name, n)), name


def test_variants_take_their_collectives_factor():
    assert bus_factor("all_reduce_many", 4) == bus_factor("all_reduce", 4) == pytest.approx(1.5)
    assert bus_factor("scatter_uneven", 4) == pytest.approx(0.75)
    assert bus_factor("barrier", 4) == bus_factor("pingpong", 4) == 1.0
    assert all(BUSBW(c, 4) > 0 for c in ALL)
