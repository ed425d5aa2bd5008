"""One job of the soak across hosts (tests/cluster/soak.py): soak_hosts.py ROUNDS.

Every rank meets the others (an all_reduce) and prints ``READY <rank> <host>``, then runs ROUNDS rounds,
each a little compute (a small numpy product, about 20 ms) and an all_reduce of 64 Ki float64 whose
every element must come out as the sum over ranks of (rank + round); a wrong sum raises.  At the end
each rank prints ``DONE <rank> <total>`` (total: the sum of every round's first element) and rank 0
prints ``CHECK <total>``, which the soak compares with the expected sum.  The soak strikes a host while
the rounds run, so a fault finds the ranks computing or inside a collective.
"""

import socket
import sys

import numpy as np

from spmd import comm

rounds = int(sys.argv[1])
x = np.ones(4)
comm.all_reduce(x)
print(f"READY {comm.rank} {socket.gethostname()}", flush=True)
a = np.full((96, 96), 0.5)
total = 0.0
for r in range(rounds):
    a = np.tanh(a @ a / 96.0)
    y = np.full(1 << 16, float(comm.rank + r))
    comm.all_reduce(y)
    want = float(sum(range(comm.size)) + comm.size * r)
    if not (y == want).all():
        raise ValueError(f"round {r}: all_reduce gave {y[0]} (and others), not {want}")
    total += y[0]
print(f"DONE {comm.rank} {total:g}", flush=True)
if comm.rank == 0:
    print(f"CHECK {total:g}", flush=True)
