"""Bus bandwidth: nccl-tests' factor per collective, used by ``spmd bench`` and ``SPMD_TRACE`` alike.

busbw = algbw * bus_factor(name, ranks): the bytes each rank's link carries,
comparable across collectives and world sizes (nccl-tests' PERFORMANCE.md).
"""

from typing import Callable, Dict

__all__ = ["BUS_FACTORS", "bus_factor"]


def _ring(n: int) -> float:
    return (n - 1) / n


#: name -> factor as a function of the number of ranks; a name not here moves its bytes once (1.0).
BUS_FACTORS: Dict[str, Callable[[int], float]] = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": _ring,
    "gather": _ring,
    "scatter": _ring,
    "all_to_all": _ring,
    "reduce_scatter": _ring,
    "scan": _ring,
    "exscan": _ring,
    "broadcast": lambda n: 1.0,
    "reduce": lambda n: 1.0,
}


def bus_factor(name: str, n: int) -> float:
    """Return nccl-tests' bus bandwidth factor of collective name at n ranks.

    A variant is its collective: ``all_reduce_many`` an all_reduce, ``scatter_uneven`` a scatter.
    """
    while name not in BUS_FACTORS and "_" in name:
        name = name.rpartition("_")[0]
    return BUS_FACTORS.get(name, lambda n: 1.0)(n)
