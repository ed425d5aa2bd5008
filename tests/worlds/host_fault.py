"""A job whose ranks are busy while a host fails: host_fault.py SECONDS [PHASE [LATE]].

PHASE says where the ranks are when tests/cluster/host_faults.py strikes a host:
- ``compute`` (the default): every rank meets the others (an all_reduce), prints ``COMPUTING <rank>
  <host>``, computes for SECONDS seconds (a small numpy product every 50 ms: light on a shared machine,
  yet the main thread is busy), then all-reduces and prints ``DONE <rank> <sum>``;
- ``init``: every rank prints ``STARTING <host>`` first of all; the ranks on host LATE then sleep for
  SECONDS (a host slow to start) and the others go on; each imports spmd, prints ``INIT <host>``, starts
  spmd (``spmd.init()``: the rendezvous, which waits for every rank) and prints ``STARTED <rank>``.  LATE
  is struck once the others said INIT: they wait in init's rendezvous for ranks that never come;
- ``collective``: every rank meets the others, prints ``COLLECTING <rank> <host>``, then all-reduces
  one number in a tight loop for SECONDS seconds (rank 0's clock: the number says whether to go on, so
  every rank makes the same calls) and prints ``DONE <rank> <calls>``.
"""

import os
import socket
import sys
import time

PHASE = sys.argv[2] if len(sys.argv) > 2 else "compute"
if PHASE == "init":
    os.write(1, f"STARTING {socket.gethostname()}\n".encode())  # one write: spmd does not keep lines whole yet
    if socket.gethostname() == sys.argv[3]:
        time.sleep(float(sys.argv[1]))

import numpy as np  # noqa: E402

import spmd  # noqa: E402
from spmd import comm  # noqa: E402

if PHASE == "init":
    os.write(1, f"INIT {socket.gethostname()}\n".encode())
    spmd.init()
    print(f"STARTED {comm.rank}", flush=True)
x = np.ones(4)
comm.all_reduce(x)
end = time.monotonic() + float(sys.argv[1])
if PHASE == "collective":
    print(f"COLLECTING {comm.rank} {socket.gethostname()}", flush=True)
    calls, going = 0, np.ones(1)
    while going[0]:
        going[0] = float(comm.rank == 0 and time.monotonic() < end)
        comm.all_reduce(going)
        calls += 1
    print(f"DONE {comm.rank} {calls}", flush=True)
    sys.exit(0)
print(f"COMPUTING {comm.rank} {socket.gethostname()}", flush=True)
a = np.full((64, 64), 0.5)
while time.monotonic() < end:
    a = np.tanh(a @ a / 64.0)
    time.sleep(0.05)
x = np.ones(4)
comm.all_reduce(x)
print(f"DONE {comm.rank} {x[0]}", flush=True)
