"""Steps of fixed compute, each ended by an all_reduce: a job whose trace shows who the collectives waited for.

Every rank does the same work per step (matrix products, not a clock), so a
rank on a slowed host comes last to each all_reduce.  Prints ``STEPS start``
per rank once started, and ``STEPS sum S rank R`` at the end (S: the sum of
every step's all_reduce, which the test checks).
"""

import os

import numpy as np

from spmd import comm

steps = int(os.environ.get("STEPS", "30"))
print(f"STEPS start rank {comm.rank} of {comm.size} host {comm.placement.host if comm.placement else None}",
      flush=True)
a = np.random.default_rng(comm.rank).random((160, 160))
total = 0.0
for step in range(steps):
    for _ in range(int(os.environ.get("PRODUCTS", "12"))):
        a = a @ a
        a /= np.abs(a).max()
    x = np.full(4, comm.rank + 1.0 + step)
    comm.all_reduce(x)
    total += float(x[0])
print(f"STEPS sum {total:g} rank {comm.rank}", flush=True)
