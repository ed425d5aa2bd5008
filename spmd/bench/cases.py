"""What each implementation runs for each collective, on float32 buffers: build, expected, check.

A case is built once per collective, implementation and layout
(:mod:`spmd.bench.builders`), so the timed call is only the call; built with
``fill=True``, ``check`` compares its result with what the collective must give.
"""

import numpy as np

from spmd.bench import builders
from spmd.bench.layout import (ALL, BUSBW, COLLECTIVES, EQUAL_FORM, EXTRAS, MESSAGES, ROOT, Case, Layout,
                               impls_for)
from spmd.errors import BenchArgumentError

__all__ = [
    "COLLECTIVES",
    "EXTRAS",
    "MESSAGES",
    "ALL",
    "BUSBW",
    "Layout",
    "Case",
    "EQUAL_FORM",
    "impls_for",
    "build",
    "expected",
    "check",
]

def build(world, collective, impl, layout, fill=False):
    """Return the Case for collective on impl with layout's buffers.

    impl is one of ``impls_for(collective, ...)``, which leaves out what an
    implementation cannot do (raw gloo's uneven scatter and gather).
    """
    if collective == "broadcast":
        return builders.broadcast(world, impl, layout, fill)
    if collective in ("reduce", "all_reduce"):
        return builders.reduction(world, impl, layout, fill, collective == "reduce")
    if collective in ("scatter", "scatter_uneven"):
        return builders.scatter(world, impl, layout, fill, collective == "scatter")
    if collective in ("gather", "gather_uneven", "all_gather"):
        return builders.gather(world, impl, layout, fill, collective == "all_gather", collective != "gather_uneven")
    if collective == "all_reduce_many":
        return builders.many(world, impl, layout, fill)
    if collective in ("pingpong", "sendrecv"):
        return builders.message(world, impl, layout, fill, collective == "pingpong")
    if collective == "all_to_all":
        return builders.all_to_all(world, impl, layout, fill)
    if collective == "reduce_scatter":
        return builders.reduce_scatter(world, impl, layout, fill)
    raise BenchArgumentError(f"unknown collective {collective!r}")


def expected(collective, layout, rank, size):
    """Return what rank must hold after a filled case ran (flat float64), or None."""
    n = layout.elems
    total = sum(layout.lengths)
    if collective == "broadcast":
        return np.arange(1, n + 1, dtype=np.float64)
    if collective.startswith("all_reduce") or (collective == "reduce" and rank == ROOT):
        return np.full(n * layout.count, size * (size + 1) / 2)
    if collective.startswith("scatter"):
        start = sum(layout.lengths[:rank])
        return np.arange(start + 1, start + layout.lengths[rank] + 1, dtype=np.float64)
    if collective == "pingpong":
        return np.arange(1, n + 1, dtype=np.float64) if rank < 2 else None
    if collective == "sendrecv":
        return np.full(n, (rank - 1) % size + 1.0)
    if collective == "all_to_all":
        return np.concatenate([np.full(m, r + 1.0) for r, m in enumerate(layout.lengths)])
    if collective == "reduce_scatter":
        return np.full(layout.lengths[rank], size * (size + 1) / 2)
    if collective == "all_gather" or (collective.startswith("gather") and rank == ROOT):
        return np.concatenate([np.full(m, r + 1.0) for r, m in enumerate(layout.lengths)]) if total else None
    return None


def check(case, collective, layout, rank, size, impl):
    """Raise AssertionError unless case's result is what collective must give."""
    want = expected(collective, layout, rank, size)
    got = builders.flat64(case.result())
    if want is None:
        return
    if got is None or got.shape != want.shape or not np.allclose(got, want):
        raise AssertionError(
            f"{impl} {collective} gave a wrong result on rank {rank}: expected {want[:8]}..., "
            f"got {None if got is None else got[:8]}..."
        )

