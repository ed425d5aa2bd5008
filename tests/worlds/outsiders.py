"""A job an outsider strikes at, in init and while it runs: outsiders.py FLAGS_DIR (tests/cluster/test_outsiders.py).

Inside spmd.init, where it starts torch's gloo group, rank 0 prints ``HELD`` and goes on to wait there
for the others, its rendezvous store open; every other rank waits for FLAGS_DIR/init before it starts
the group.  After init every rank prints ``RUNNING rank <r>``, and the ranks loop (an all_reduce, a
broadcast, a ring of send/recv, then 0.2 s of compute) until rank 0 sees FLAGS_DIR/run, checking each
result as they go.  Then a fixed piece of work; rank 0 prints its bytes' and the loop's first 10
rounds' ``CHECKSUM <sha256>``, which depends only on the world size (integer values: every sum is
exact in any order), not on the launcher or on how long the outsider took.  Every rank prints
``DONE rank <r>`` last.  With both flags made beforehand, nothing waits.
"""

import hashlib
import os
import sys
import time

import numpy as np
import torch.distributed as dist

from spmd.config.placement import detect

FLAGS = sys.argv[1]
ROUNDS = 10  # the loop's rounds counted in the checksum; more may run while the outsider strikes


def wait_for(path, seconds=120):
    deadline = time.monotonic() + seconds
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.05)


rank = detect().rank
_start_group = dist.init_process_group


def held_in_init(*args, **kwargs):
    """torch's group start, inside spmd.init: rank 0 says HELD and goes on to wait there for the others (its
    rendezvous store open); every other rank first waits for FLAGS/init."""
    if rank == 0:
        print("HELD", flush=True)
    else:
        wait_for(os.path.join(FLAGS, "init"))
    return _start_group(*args, **kwargs)


dist.init_process_group = held_in_init  # spmd starts gloo's group through torch.distributed's attribute
import spmd  # noqa: E402

comm = spmd.init()
size, digest = comm.size, hashlib.sha256()
print(f"RUNNING rank {comm.rank}", flush=True)


def one_round(i):
    """An all_reduce, a broadcast and a ring of send/recv whose answers are known: check them, return them."""
    x = (np.arange(4096, dtype=np.float64) % 97) * (comm.rank + 1) + i
    comm.all_reduce(x)
    expect = (np.arange(4096) % 97) * (size * (size + 1) // 2) + i * size
    assert np.array_equal(x, expect), f"round {i}: a wrong all_reduce"
    b = np.full(1024, float(i), dtype=np.float64) if comm.rank == 0 else np.zeros(1024)
    comm.broadcast(b, root=0)
    assert np.all(b == i), f"round {i}: a wrong broadcast"
    right, left = (comm.rank + 1) % size, (comm.rank - 1) % size
    if comm.rank % 2 == 0:
        comm.send(np.full(256, float(comm.rank * 1000 + i)), dst=right)
        got = comm.recv(src=left)
    else:
        got = comm.recv(src=left)
        comm.send(np.full(256, float(comm.rank * 1000 + i)), dst=right)
    assert np.all(got == left * 1000 + i), f"round {i}: a wrong message from rank {left}"
    return x, b


i = 0
while True:
    x, b = one_round(i)
    if i < ROUNDS:
        digest.update(x.tobytes() + b.tobytes())
    time.sleep(0.2)  # compute between collectives: the outsider strikes here as well as in them
    i += 1
    if comm.broadcast_object(i >= ROUNDS and os.path.exists(os.path.join(FLAGS, "run")), root=0):
        break

rng = np.random.default_rng(1234 + comm.rank)
part = rng.integers(0, 1 << 20, size=1 << 17).astype(np.float64)  # 1 MiB a rank
comm.all_reduce(part)
digest.update(part.tobytes())
blob = np.frombuffer(np.random.default_rng(99).bytes(1 << 20), dtype=np.uint8).copy() if comm.rank == 0 \
    else np.zeros(1 << 20, dtype=np.uint8)
comm.broadcast(blob, root=0)
digest.update(blob.tobytes())
for piece in comm.all_gather_object(hashlib.sha256(part.tobytes() + blob.tobytes()).hexdigest()):
    digest.update(piece.encode())
if comm.rank == 0:
    print(f"CHECKSUM {digest.hexdigest()} rounds {i}", flush=True)
comm.barrier()
print(f"DONE rank {comm.rank}", flush=True)
