"""A job whose ranks compute while a host fails: host_fault.py SECONDS.

Every rank meets the others (an all_reduce), prints ``COMPUTING <rank> <host>``, computes for SECONDS
seconds (a small numpy product every 50 ms: light on a shared machine, yet the main thread is busy), then
all-reduces and prints ``DONE <rank> <sum>``.  tests/cluster/host_faults.py strikes a host meanwhile.
"""

import socket
import sys
import time

import numpy as np

from spmd import comm

x = np.ones(4)
comm.all_reduce(x)
print(f"COMPUTING {comm.rank} {socket.gethostname()}", flush=True)
a = np.full((64, 64), 0.5)
end = time.monotonic() + float(sys.argv[1])
while time.monotonic() < end:
    a = np.tanh(a @ a / 64.0)
    time.sleep(0.05)
x = np.ones(4)
comm.all_reduce(x)
print(f"DONE {comm.rank} {x[0]}", flush=True)
