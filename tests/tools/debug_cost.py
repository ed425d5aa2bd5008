"""Measure what SPMD_DEBUG and SPMD_TRACE cost per collective (docs/reliability.md).

Run under a launcher: mpirun -n 2 python tests/tools/debug_cost.py [gloo|mpi]
"""

import os
import sys
import tempfile
import time

import numpy as np

import spmd
from spmd.failfast.calls import Monitor

comm = spmd.init(backend=sys.argv[1] if len(sys.argv) > 1 else None)


def per_call(fn, n=2000):
    comm.barrier()
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return sorted(times)[n // 2] * 1e6


rows = []
for nbytes in (8, 64 * 1024, 4 * 1024 * 1024):
    x = np.ones(nbytes // 8)
    n = 2000 if nbytes < 1e6 else 50
    results = {}
    trace = os.path.join(tempfile.gettempdir(), "spmd-debug-cost-trace.json")
    for mode, monitor in (("plain", Monitor()), ("debug", Monitor(debug=True)),
                          ("trace", Monitor(trace=trace))):
        comm._mon = monitor
        results[mode] = per_call(lambda: comm.all_reduce(x), n)
    comm._mon = Monitor()  # no trace report at finalize
    rows.append((nbytes, results))
if comm.rank == 0:
    print(f"all_reduce on {comm.size} ranks, backend {comm.backend}: median microseconds per call")
    print("| bytes | plain | debug | trace |")
    print("|---|---|---|---|")
    for nbytes, r in rows:
        print(f"| {nbytes} | {r['plain']:.1f} | {r['debug']:.1f} | {r['trace']:.1f} |")
