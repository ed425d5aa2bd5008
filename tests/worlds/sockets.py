"""Every listening socket of a rank, and a job that outlives an outsider: sockets.py MODE [FLAGS_DIR] [MARK].

MODE list: after init and a collective, each rank prints ``SOCKETS <rank> <json>``:
its listening TCP sockets ({inode: [host, port]}) and those it shares with the
processes above it (the launcher's, inherited).  MODE outsider: rank 0 prints
``PID 0 <pid>`` (under MPI once every rank has started MPI); rank 1 enters spmd.init only once FLAGS_DIR/init exists, and after
init the ranks wait for FLAGS_DIR/run before their collectives, so a test can
try rank 0's sockets while the others wait in init and while the job runs.
"""

import json
import os
import sys
import time

import numpy as np
from listening import ancestors, listening

from spmd.config.placement import detect


def wait_for(path, seconds=60):
    deadline = time.monotonic() + seconds
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.05)


mode = sys.argv[1]
flags = sys.argv[2] if len(sys.argv) > 2 else None
rank = detect().rank
if mode == "outsider":
    if os.environ.get("SPMD_BACKEND") == "mpi" or "PMI_RANK" in os.environ:
        # MPI's own sockets first, the store's after the PID line; on every rank, since MPICH's
        # MPI_Init waits for all (spmd.init then finds MPI started on every rank alike).
        from mpi4py import MPI  # noqa: F401
    if rank == 0:
        print(f"PID 0 {os.getpid()}", flush=True)
    else:
        wait_for(os.path.join(flags, "init"))
import spmd  # noqa: E402

comm = spmd.init()
x = np.arange(4.0) + comm.rank
comm.all_reduce(x)
if mode == "outsider":
    print(f"RUNNING rank {comm.rank}", flush=True)
    wait_for(os.path.join(flags, "run"))
    for _ in range(3):
        y = np.ones(8) * comm.rank
        comm.all_reduce(y)
        assert y.tolist() == [sum(range(comm.size))] * 8, y
    assert comm.broadcast_object({"from": 0, "rank": comm.rank}, root=0) == {"from": 0, "rank": 0}
own = listening()
inherited = set().union(*(set(listening(pid)) for pid in ancestors())) if ancestors() else set()
print(f"SOCKETS {comm.rank} " + json.dumps({"own": {k: v for k, v in own.items() if k not in inherited},
                                            "inherited": {k: v for k, v in own.items() if k in inherited},
                                            "sum": x.tolist()}), flush=True)
comm.barrier()
