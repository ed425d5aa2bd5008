"""One short job of the soak (tests/tools/soak.py): soak_job.py KIND [MARK].

KIND is success, raise, sigkill, hang or launcher-kill. MARK is ignored: the soak puts a
unique word on every rank's command line (and in its environment) to find, in the
process table, what a job left behind.

Every rank prints ``READY rank R`` once its first collectives are done: the soak measures
each promise from the moment both ranks are ready (the fault is triggered right after).
Just before, ``SHM rank R: PATHS`` names the /dev/shm segments it has mapped (MPICH's,
under mpirun), for the soak to look for once the job has ended.

If SOAK_GATE names a directory, each rank creates a file there once torch is imported and
waits until every rank has, before init: importing torch on oversubscribed cores takes
seconds and varies, and SPMD_TIMEOUT=3 (the hang kind's) also bounds init.
"""

import os
import signal
import sys
import time

import torch

from spmd.config.placement import detect

kind = sys.argv[1]
me = detect()
gate = os.environ.get("SOAK_GATE")
if gate:
    open(os.path.join(gate, f"rank{me.rank}"), "w").close()
    deadline = time.monotonic() + 120
    while len(os.listdir(gate)) < me.size and time.monotonic() < deadline:
        time.sleep(0.02)

from spmd import comm  # noqa: E402 - after the gate: comm starts on first use

r, n = comm.rank, comm.size
x = torch.ones(64) * (r + 1)
comm.all_reduce(x)
assert x[0].item() == n * (n + 1) / 2, x[0].item()
comm.barrier()
# The shared-memory segments this rank has mapped (MPICH's, under mpirun): the soak looks for them
# once the job has ended, so that a segment of another user's job is not counted as this one's.
with open("/proc/self/maps") as maps:
    shm = sorted({line.split(None, 5)[5].strip() for line in maps
                  if "/dev/shm/" in line and not line.rstrip().endswith("(deleted)")})
print(f"SHM rank {r}: {' '.join(shm) or '-'}", flush=True)
print(f"READY rank {r}", flush=True)

if kind == "success":
    for step in range(3):
        y = torch.full((256,), float(r + step))
        comm.all_reduce(y)
        assert y[0].item() == sum(k + step for k in range(n)), (step, y[0].item())
    z = torch.arange(8.0) if r == 0 else torch.zeros(8)
    comm.broadcast(z, root=0)
    assert z[7].item() == 7.0, z
    comm.barrier()
elif kind == "raise":
    if r == 1:
        raise ValueError("soak: rank 1 raised on purpose")
    comm.all_reduce(x)
elif kind == "sigkill":
    if r == 1:
        time.sleep(0.5)  # let the others enter the collective first
        os.kill(os.getpid(), signal.SIGKILL)
    comm.all_reduce(x)
elif kind == "hang":
    if r == 1:
        time.sleep(600)  # never comes to the collective rank 0 waits in
    comm.all_reduce(x)
elif kind == "launcher-kill":
    # The soak SIGKILLs the launcher once every rank is ready: the ranks must go with it.
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        comm.all_reduce(x)
        time.sleep(0.05)
    print(f"SURVIVED rank {r}", flush=True)
else:
    sys.exit(f"unknown kind {kind}")
print(f"DONE rank {r}", flush=True)
