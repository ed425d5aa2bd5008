"""Which tests run together under a launcher: waves of tests on disjoint ranks.

``waves(sizes, world)`` packs the tests (sizes[i] ranks for test i; an
unmarked test needs one) into waves, first fit in collection order: a
wave is a set of tests on disjoint ranks of the world that run at the
same time, and the world meets between waves.  Every rank computes the
same plan from the same collection, so no rank waits for another to be
told its part.  A test that needs more ranks than the world has is left
out (``too_big``).
"""

from __future__ import annotations

from typing import NamedTuple

from spmd.errors import MarkerError

__all__ = ["Slot", "waves", "too_big"]


class Slot(NamedTuple):
    """One test of a wave: its index in the collection and the world ranks it runs on."""

    index: int
    ranks: tuple[int, ...]


def too_big(sizes: list[int], world: int) -> list[int]:
    """The indices of the tests that need more ranks than the world has."""
    return [i for i, n in enumerate(sizes) if n > world]


def waves(sizes: list[int], world: int) -> list[list[Slot]]:
    """Pack the tests that fit into waves (first fit, in collection order); ranks are given in order."""
    if world < 1:
        raise MarkerError(f"the world must have at least one rank, got {world}")
    free: list[int] = []  # free ranks in each wave
    plan: list[list[tuple[int, int]]] = []  # (index, size) in each wave
    for i, n in enumerate(sizes):
        if n < 1:
            raise MarkerError(f"test {i} asks for {n} ranks")
        if n > world:
            continue
        for w, left in enumerate(free):
            if left >= n:
                plan[w].append((i, n))
                free[w] -= n
                break
        else:
            plan.append([(i, n)])
            free.append(world - n)
    out = []
    for tests in plan:
        wave, first = [], 0
        for i, n in sorted(tests):
            wave.append(Slot(i, tuple(range(first, first + n))))
            first += n
        out.append(wave)
    return out
