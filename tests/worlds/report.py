"""One report per job: report.py SCENARIO (see tests/failfast/test_report.py).

two-errors: every rank raises the same error but rank 1, whose error differs.
hang: rank 1 sleeps while the others all_reduce (run it with a short SPMD_TIMEOUT).
usr2: every rank prints its pid and sleeps a few seconds (the test sends SIGUSR2), then ends normally.
"""

import os
import sys
import time

import numpy as np

import spmd

scenario = sys.argv[1]
comm = spmd.init()
r = comm.rank
comm.barrier()
print(f"READY rank {r} pid {os.getpid()}", flush=True)

if scenario == "two-errors":
    if r == 1:
        raise KeyError("rank 1 has no such column")
    raise ValueError(f"rank {r} found a bad record")
elif scenario == "hang":
    if r == 1:
        time.sleep(60)  # the sleeping rank
    comm.all_reduce(np.ones(4))  # the waiting ranks
elif scenario == "usr2":
    time.sleep(5)  # the test's kill -USR2 comes meanwhile
    comm.all_reduce(np.ones(4))
else:
    sys.exit(f"unknown scenario {scenario}")
print(f"DONE rank {r}", flush=True)
