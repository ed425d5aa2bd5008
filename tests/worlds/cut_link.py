"""Raw mpi4py, for the lab's honesty: cut_link.py FLAG. Each rank prints READY after a barrier, waits
for the file FLAG, then all-reduces and prints DONE (which must not happen across a cut link)."""

import os
import sys
import time

import numpy as np
from mpi4py import MPI

world = MPI.COMM_WORLD
world.Barrier()
print(f"READY {world.Get_rank()}", flush=True)
while not os.path.exists(sys.argv[1]):
    time.sleep(0.05)
x = np.ones(1 << 16)
world.Allreduce(MPI.IN_PLACE, x)
print(f"DONE {world.Get_rank()} {x[0]}", flush=True)
