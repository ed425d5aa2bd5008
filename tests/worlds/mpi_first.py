"""A job where some ranks started MPI themselves before spmd.init and others did not: mpi_first.py.

Rank 0 imports mpi4py.MPI (MPI_Init) first; rank 1 waits a moment and lets
spmd.init start MPI.  Each rank then prints ``SEGMENTS <rank> <json>``: the
MPICH /dev/shm segments it maps that still have a name (none: spmd released
them on every rank alike) and the sum of an all_reduce.
"""

import json
import time

from spmd.config.placement import detect

if detect().rank == 0:
    from mpi4py import MPI  # noqa: F401
else:
    time.sleep(1.0)  # rank 0 reaches spmd.init first

import numpy as np  # noqa: E402

import spmd  # noqa: E402
from spmd.runtime.mpishm import mapped_segments  # noqa: E402

comm = spmd.init()
x = np.arange(3.0) + comm.rank
comm.all_reduce(x)
print(f"SEGMENTS {comm.rank} " + json.dumps({"named": mapped_segments(), "sum": x.tolist()}), flush=True)
comm.barrier()
