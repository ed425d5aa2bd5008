"""The collective benchmark: spmd against raw mpi4py and raw torch.distributed.

Inside a launched job (``mpirun -n 2 spmd bench collectives``)::

    from spmd.bench import Settings, open_world, run
    world = open_world()                  # mpi4py, gloo and spmd on both, at once
    rows = run(world, Settings(sizes=(8, 1 << 20)))

Each row is one collective, implementation and size: median time, its
spread, algbw and busbw (nccl-tests' definitions).  ``spmd.bench.measure``
describes the timing method.  Importing this package imports neither
torch nor mpi4py.
"""

from spmd.bench.cases import BUSBW, COLLECTIVES, EXTRAS
from spmd.bench.measure import Settings, default_sizes, format_size, layout, parse_size, run
from spmd.bench.communicators import IMPLS, World, open_alone, open_world

__all__ = [
    "BUSBW",
    "COLLECTIVES",
    "EXTRAS",
    "IMPLS",
    "Settings",
    "World",
    "default_sizes",
    "format_size",
    "layout",
    "open_alone",
    "open_world",
    "parse_size",
    "run",
]
