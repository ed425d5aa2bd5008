"""Raw MPI or raw gloo, for the lab's honesty: cut_link.py FLAG [mpi|gloo]. Each rank prints READY after a
barrier, waits for the file FLAG, then all-reduces and prints DONE (which must not happen across a cut
link).  gloo: torch.distributed alone (no spmd), ranks from Hydra's PMI_RANK and PMI_SIZE, meeting at
MASTER_ADDR:MASTER_PORT, its pair sockets on GLOO_SOCKET_IFNAME."""

import os
import sys
import time

import numpy as np

backend = sys.argv[2] if len(sys.argv) > 2 else "mpi"
if backend == "gloo":
    import torch
    import torch.distributed as dist

    rank, size = int(os.environ["PMI_RANK"]), int(os.environ["PMI_SIZE"])
    dist.init_process_group("gloo", init_method=f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}",
                            rank=rank, world_size=size)
    dist.barrier()
else:
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    world.Barrier()
print(f"READY {rank}", flush=True)
while not os.path.exists(sys.argv[1]):
    time.sleep(0.05)
if backend == "gloo":
    t = torch.ones(1 << 16, dtype=torch.float64)
    dist.all_reduce(t)
    total = float(t[0])
else:
    x = np.ones(1 << 16)
    world.Allreduce(MPI.IN_PLACE, x)
    total = x[0]
print(f"DONE {rank} {total}", flush=True)
