"""One failure scenario per run: faults.py SCENARIO [MARK] (see the table in docs/reliability.md).

MARK is ignored: the tests put a unique word on every rank's command line to
find, in the process table, what a run left behind.
"""

import os
import signal
import sys
import threading
import time

import numpy as np

import spmd
import spmd.failfast.hub
from spmd.config.placement import detect

scenario = sys.argv[1]
if scenario == "late" and detect().rank == 1:
    time.sleep(120)  # to the others, a rank that never starts
if scenario == "init-death" and detect().rank == 1:
    # Die inside init: the backend has started, this rank's hub handshake has not
    # (the others are in init too, waiting for this rank in the hub or init's barrier).
    spmd.failfast.hub.HubClient.__init__ = lambda *args, **kw: os.kill(os.getpid(), signal.SIGKILL)
if scenario == "gather-kill":  # allocated before READY: 128 MiB of float32 from each rank
    big = np.ones(32 << 20, dtype=np.float32)
if not any(v in os.environ for v in ("PMI_RANK", "OMPI_COMM_WORLD_RANK")):
    import torch.distributed  # noqa: F401  (a gloo job imports it first: init's clock starts after it)
# The promise "init fails within the timeout" starts here (tests.support.since_promise reads the time).
print(f"INIT rank {detect().rank} SPMD-PROMISE-AT {time.monotonic():.6f}", flush=True)
comm = spmd.init()
r = comm.rank
x = np.ones(1000)
comm.barrier()
print(f"READY rank {r}", flush=True)

if scenario == "raise":
    if r == 1:
        raise ValueError("rank 1 found a bad record")
    comm.all_reduce(x)
elif scenario == "sigkill":
    if r == 1:
        time.sleep(0.5)  # let the others enter the collective first
        os.kill(os.getpid(), signal.SIGKILL)
    comm.all_reduce(x)
elif scenario in ("mismatch", "mismatch-late"):
    if r == 0:
        comm.broadcast(x, root=0)
    else:
        if scenario == "mismatch-late":
            time.sleep(1.0)  # rank 0 times out first; gloo then closes rank 1's connection
        comm.all_reduce(x)
elif scenario == "stall":  # rank 1 never comes: rank 0 waits in all_gather's description exchange
    if r == 0:
        comm.all_gather(x)
    else:
        time.sleep(60)
elif scenario == "async-stall":  # rank 1 never comes: rank 0 waits in its async all_reduce's wait()
    if r == 0:
        handle = comm.all_reduce(x, async_op=True)
        handle.wait()
    else:
        time.sleep(60)
elif scenario == "shapes":
    comm.all_reduce(np.ones(3 + r))
elif scenario == "equal":  # equal=True promises one shape; debug mode checks the promise
    comm.all_gather(np.ones(3 + r), equal=True, out=np.zeros(2 * (3 + r)))
elif scenario == "deadlock":  # both receive first: each waits for a message the other never sends
    got = comm.recv((r + 1) % comm.size, tag=3)
    comm.send(x, (r + 1) % comm.size, tag=3)
elif scenario == "p2p-shape":  # a receive into an out that does not fit what was sent
    if r == 0:  # 160 KB: the blocking send waits for the receive, so it hears the verdict (debug mode)
        comm.send(np.zeros(20000), 1, tag=2)
    elif r == 1:
        comm.recv(0, tag=2, out=np.empty(3))
    comm.barrier()
elif scenario == "debug-ring":  # rings of immediate and small blocking sends in debug mode
    right, left = (r + 1) % comm.size, (r - 1) % comm.size
    assert comm.sendrecv(np.full(3, r), right, left)[0] == left
    assert comm.sendrecv(np.full(100000, r), right, left)[0] == left
    comm.send(np.full(5, r), right, tag=4)
    assert comm.recv(left, tag=4)[0] == left
    print(f"RING OK rank {r}", flush=True)
elif scenario == "p2p-kill":  # rank 0 waits for a message from a rank that dies
    if r == 1:
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)
    comm.recv(1, tag=1)
elif scenario == "gather-kill":  # a rank SIGKILLed while the others wait in a 256 MiB gather
    if r == 1:
        time.sleep(0.5)  # rank 0 waits inside the gather by then
        threading.Timer(0.05, os.kill, (os.getpid(), signal.SIGKILL)).start()  # mid-send
    got = comm.gather(big, root=0)
    print(f"GATHERED rank {r}", flush=True)  # must not happen: rank 1 died before its data arrived
elif scenario == "outsider":  # the test fuzzes the hub from outside, then touches the go file
    if r == 0:
        hub = next(g for g in spmd.runtime.start._guards if isinstance(g, spmd.failfast.hub.Hub))
        print(f"HUB {hub.address[0]} {hub.address[1]}", flush=True)
    go = os.environ["FAULTS_GO"]
    while not os.path.exists(go):
        time.sleep(0.05)
    total = comm.all_reduce(np.array([r + 1.0]))
    print(f"SURVIVED rank {r} sum {total[0]:g}", flush=True)
    if os.environ.get("FAULTS_ENDING") == "raise" and r == 1:
        raise ValueError("rank 1 found a bad record after the fuzz")
    comm.barrier()
elif scenario not in ("late", "init-death"):
    sys.exit(f"unknown scenario {scenario}")
print(f"DONE rank {r}", flush=True)
