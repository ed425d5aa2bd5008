"""mpi4py's documentation "Tutorial" page, ported to spmd's comm (no mpi4py here).

Each section follows one of the tutorial's examples: point to point of
Python objects and of numpy arrays (blocking and immediate), the
collectives of objects and of arrays, the parallel matrix-vector product
and pi by numerical integration; then three the tutorial lacks: a
distributed transpose by all_to_all, reduce_scatter and prefix sums.
Expected values are computed from rank and size, so the script works at
every size >= 2, on every backend.  A failed check raises AssertionError
naming the rank; at the end every rank prints one line:
``TUTORIAL OK rank <r> size <n> backend <b> checks <k>``.
"""

import math
import pickle

import numpy as np

from spmd import comm

rank, size = comm.rank, comm.size
checks = 0


def ok(cond, what):
    global checks
    if not cond:
        raise AssertionError(f"rank {rank} of {size} ({comm.backend}): {what}")
    checks += 1


def same(got, want, what):
    got = np.asarray(got.numpy() if hasattr(got, "numpy") else got)
    ok(got.dtype == np.asarray(want).dtype and np.array_equal(got, want), f"{what}: got {got!r}, expected {want!r}")


if size < 2:
    raise SystemExit(f"rank {rank}: the tutorial needs at least 2 ranks, got {size}")

# -- point to point: Python objects ----------------------------------------------------
# mpi4py: comm.send(data, dest=1, tag=11) / data = comm.recv(source=0, tag=11)
if rank == 0:
    data = {"a": 7, "b": 3.14}
    comm.send_object(data, 1, tag=11)
elif rank == 1:
    data = comm.recv_object(0, tag=11)
    ok(data == {"a": 7, "b": 3.14}, f"recv_object from 0: {data!r}")

# Every rank sends an object to the next one; the receiver takes it from any source.
nxt, prev = (rank + 1) % size, (rank - 1) % size
sending = comm.isend(np.frombuffer(pickle.dumps({"from": rank, "items": list(range(rank))}), np.uint8), nxt, tag=12)
got, src, tag = comm.recv_object(None, tag=12, status=True)
sending.wait()
ok((src, tag) == (prev, 12), f"recv_object status: source {src}, tag {tag}; expected {prev}, 12")
ok(got == {"from": prev, "items": list(range(prev))}, f"recv_object from any source: {got!r}")

# -- point to point, non-blocking: Python objects ----------------------------------------
# mpi4py: req = comm.isend(data, dest=1, tag=11); req.wait() / req = comm.irecv(source=0, tag=11); data = req.wait()
# spmd's immediate calls move arrays: an object travels as its pickle, a uint8 array.
if rank == 0:
    data = {"a": 7, "b": 3.14}
    req = comm.isend(np.frombuffer(pickle.dumps(data), np.uint8), 1, tag=11)
    req.wait()
elif rank == 1:
    req = comm.irecv(0, tag=11)
    data = pickle.loads(req.wait().tobytes())
    ok(data == {"a": 7, "b": 3.14}, f"irecv of a pickled dict: {data!r}")
    ok((req.source, req.tag) == (0, 11), f"irecv handle: source {req.source}, tag {req.tag}")

# -- point to point: numpy arrays ------------------------------------------------------------
# mpi4py, datatypes explicit: comm.Send([data, MPI.INT], dest=1, tag=77) / comm.Recv([data, MPI.INT], source=0, tag=77)
# spmd: the receiver's out= is the preallocated buffer; its dtype and shape must match.
if rank == 0:
    data = np.arange(1000, dtype="i")
    comm.send(data, 1, tag=77)
elif rank == 1:
    data = np.empty(1000, dtype="i")
    back = comm.recv(0, tag=77, out=data)
    ok(back is data, "recv(out=data) returns data itself")
    same(data, np.arange(1000, dtype="i"), "recv into a preallocated int32 buffer")

# mpi4py, automatic datatype discovery: comm.Send(data, dest=1, tag=13) / comm.Recv(data, source=0, tag=13)
# spmd goes further: without out=, dtype and shape come with the message.
if rank == 0:
    data = np.arange(100, dtype=np.float64)
    comm.send(data, 1, tag=13)
    comm.send(np.arange(12, dtype=np.int16).reshape(3, 4), 1, tag=14)
elif rank == 1:
    data = np.empty(100, dtype=np.float64)
    comm.recv(0, tag=13, out=data)
    same(data, np.arange(100, dtype=np.float64), "recv into a preallocated float64 buffer")
    got = comm.recv(0, tag=14)
    same(got, np.arange(12, dtype=np.int16).reshape(3, 4), "recv discovering dtype int16 and shape (3, 4)")

# A ring of arrays at any size: each rank sends rank-dependent rows to the next.
mine = np.full((rank + 1, 3), rank, dtype=np.int64)
got = comm.sendrecv(mine, nxt, prev, tag=15)
same(got, np.full((prev + 1, 3), prev, dtype=np.int64), "sendrecv around the ring")

# -- point to point, non-blocking: numpy arrays --------------------------------------------------
# mpi4py: req = comm.Isend(...); req.Wait() / req = comm.Irecv(...); req.Wait()
reqs = [comm.irecv(src, tag=16) for src in range(size) if src != rank]
sends = [comm.isend(np.arange(rank * 10, rank * 10 + 5, dtype=np.float32), dst, tag=16)
         for dst in range(size) if dst != rank]
for req in reqs:
    got = req.wait()
    same(got, np.arange(req.source * 10, req.source * 10 + 5, dtype=np.float32), f"irecv from {req.source}")
for req in sends:
    req.wait()
buf = np.empty(4, dtype=np.int32)
req_in = comm.irecv(prev, tag=17, out=buf)
req_out = comm.isend(np.full(4, rank, dtype=np.int32), nxt, tag=17)
req_out.wait()
ok(req_in.wait() is buf, "irecv(out=buf).wait() returns buf")
same(buf, np.full(4, prev, dtype=np.int32), "irecv into a preallocated buffer")

# -- collectives: Python objects ----------------------------------------------------------------
# mpi4py: data = comm.bcast(data, root=0)
data = {"key1": [7, 2.72, 2 + 3j], "key2": ("abc", "xyz")} if rank == 0 else None
data = comm.broadcast_object(data, root=0)
ok(data == {"key1": [7, 2.72, 2 + 3j], "key2": ("abc", "xyz")}, f"broadcast_object: {data!r}")

# mpi4py: data = comm.scatter(data, root=0), data = [(i+1)**2 for i in range(size)] on root
data = [(i + 1) ** 2 for i in range(size)] if rank == 0 else None
data = comm.scatter_object(data, root=0)
ok(data == (rank + 1) ** 2, f"scatter_object: {data!r}")

# mpi4py: data = comm.gather(data, root=0)
data = comm.gather_object((rank + 1) ** 2, root=0)
if rank == 0:
    ok(data == [(i + 1) ** 2 for i in range(size)], f"gather_object: {data!r}")
else:
    ok(data is None, f"gather_object off root: {data!r}")
data = comm.all_gather_object({"rank": rank})
ok(data == [{"rank": i} for i in range(size)], f"all_gather_object: {data!r}")

# -- collectives: numpy arrays -------------------------------------------------------------------
# mpi4py: comm.Bcast(data, root=0), data = np.arange(100, dtype='i') on root, np.empty elsewhere
data = np.arange(100, dtype="i") if rank == 0 else np.empty(100, dtype="i")
comm.broadcast(data, root=0)
same(data, np.arange(100, dtype="i"), "broadcast of an int32 array")

# mpi4py: comm.Scatter(sendbuf, recvbuf, root=0), sendbuf of shape (size, 100) with row i all i
sendbuf = None
if rank == 0:
    sendbuf = np.empty([size, 100], dtype="i")
    sendbuf.T[:, :] = range(size)
recvbuf = comm.scatter(sendbuf, root=0)
same(recvbuf, np.full((1, 100), rank, dtype="i"), "scatter of an int32 array's rows")
recvbuf = np.empty(100, dtype="i")
comm.scatter(list(sendbuf) if rank == 0 else None, root=0, out=recvbuf)
same(recvbuf, np.full(100, rank, dtype="i"), "scatter into a preallocated buffer")

# mpi4py: comm.Gather(sendbuf, recvbuf, root=0), sendbuf = np.zeros(100, dtype='i') + rank
sendbuf = np.zeros(100, dtype="i") + rank
recvbuf = comm.gather(sendbuf, root=0)
if rank == 0:
    same(np.stack(recvbuf), np.repeat(np.arange(size, dtype="i")[:, None], 100, axis=1), "gather of int32 arrays")
else:
    ok(recvbuf is None, "gather off root")
# mpi4py: comm.Allgather; lengths may differ here (MPI's Allgatherv)
rows = comm.all_gather(np.full(rank + 1, rank, dtype=np.float64))
same(np.concatenate(rows), np.repeat(np.arange(size, dtype=np.float64), np.arange(1, size + 1)),
     "all_gather of arrays of lengths 1 to size")

# -- parallel matrix-vector product ---------------------------------------------------------------
# mpi4py: def matvec(comm, A, x): xg = zeros(m*p); comm.Allgather([x, MPI.DOUBLE], [xg, MPI.DOUBLE]); return dot(A, xg)
# Rank r holds rows r*m .. r*m+m-1 of A and the same entries of x.
m = 3
full_A = np.random.default_rng(42).standard_normal((m * size, m * size))
full_x = np.random.default_rng(43).standard_normal(m * size)
A, x = full_A[rank * m:(rank + 1) * m], full_x[rank * m:(rank + 1) * m]
xg = np.empty(m * size)
comm.all_gather(x, equal=True, out=xg)
y = A @ xg
ok(np.allclose(y, (full_A @ full_x)[rank * m:(rank + 1) * m]), "matvec: this rank's block of A @ x")
yg = np.concatenate(comm.all_gather(y))
ok(np.allclose(yg, full_A @ full_x), "matvec: the whole product, gathered")

# -- compute pi: the integral of 4 / (1 + x^2) over [0, 1], midpoint rule ----------------------
# Rank r sums the intervals r, r + size, r + 2 size, ... (the classic cpi.c split).
intervals = 10_000
h = 1.0 / intervals
mids = h * (np.arange(rank, intervals, size) + 0.5)
part = np.array([h * np.sum(4.0 / (1.0 + mids * mids))])
pi = part.copy()
comm.reduce(pi, root=0, op="sum")
if rank == 0:
    ok(abs(pi[0] - math.pi) < 1e-8, f"pi by reduce: {pi[0]!r}")
else:
    ok(np.array_equal(pi, part), "reduce leaves x unchanged off root")
pi = comm.all_reduce(part.copy(), op="sum")
ok(abs(pi[0] - math.pi) < 1e-8, f"pi by all_reduce: {pi[0]!r}")
import torch  # noqa: E402  (the same with a torch tensor)

pi_t = torch.tensor([float(part[0])], dtype=torch.float64)
comm.all_reduce(pi_t)
ok(abs(float(pi_t[0]) - math.pi) < 1e-8, f"pi by all_reduce of a tensor: {float(pi_t[0])!r}")

# -- beyond the tutorial: a distributed transpose by all_to_all ------------------------------------
# M (b size x b size, M[i, j] = 1000 i + j) is distributed by blocks of b rows; rank r ends up with
# rows r*b .. r*b+b-1 of M.T.  Rank r sends rank j the block M[r rows, j cols], transposed.
b = 2
N = b * size
M = 1000 * np.arange(N)[:, None] + np.arange(N)[None, :]
mine = M[rank * b:(rank + 1) * b]
chunks = [np.ascontiguousarray(mine[:, j * b:(j + 1) * b].T) for j in range(size)]
got = comm.all_to_all(chunks)
ok(len(got) == size, f"all_to_all gives {len(got)} chunks")
same(np.concatenate(got, axis=1), M.T[rank * b:(rank + 1) * b], "all_to_all transpose")
out = np.empty((size * b, b), dtype=M.dtype)
got = comm.all_to_all(chunks, equal=True, out=out)
same(np.concatenate(got, axis=1), M.T[rank * b:(rank + 1) * b], "all_to_all(equal=True, out=) transpose")
# Lengths may differ (MPI's alltoallv): rank r sends rank j (r + j) % 3 rows of value 10 r + j.
sent = [np.full(((rank + j) % 3, 2), 10 * rank + j, dtype=np.int32) for j in range(size)]
got = comm.all_to_all(sent)
for j, chunk in enumerate(got):
    same(chunk, np.full(((j + rank) % 3, 2), 10 * j + rank, dtype=np.int32), f"all_to_all chunk from {j}")

# -- reduce_scatter --------------------------------------------------------------------------------
# Every rank contributes x[k] = (rank + 1) * k; rank r gets block r of the sum over ranks.
length = 2 * size + 1  # no size divides it evenly
x = (rank + 1) * np.arange(length, dtype=np.int64)
block = comm.reduce_scatter(x, op="sum")
total = (size * (size + 1) // 2) * np.arange(length, dtype=np.int64)
same(block, np.array_split(total, size)[rank], "reduce_scatter sum")
block = comm.reduce_scatter(np.full(size, float(rank)), op="max")
same(block, np.array([float(size - 1)]), "reduce_scatter max")

# -- prefix sums: scan and exscan ------------------------------------------------------------------
values = np.arange(1, size + 1)  # rank r contributes r + 1
x = np.array([rank + 1, 2 * (rank + 1)], dtype=np.int64)
comm.scan(x, op="sum")
same(x, np.array([1, 2]) * np.cumsum(values)[rank], "scan sum")
x = np.array([rank + 1, 2 * (rank + 1)], dtype=np.int64)
comm.exscan(x, op="sum")
same(x, np.array([1, 2]) * (np.cumsum(values)[rank] - (rank + 1)), "exscan sum")
x = np.array([float(rank + 1)])
comm.scan(x, op="prod")
same(x, np.array([float(math.factorial(rank + 1))]), "scan prod")
x = np.array([(rank * 7) % size], dtype=np.int32)
comm.scan(x, op="max")
same(x, np.array([max((k * 7) % size for k in range(rank + 1))], dtype=np.int32), "scan max")
x = np.array([rank], dtype=np.int32)
comm.exscan(x, op="min")
want = np.iinfo(np.int32).max if rank == 0 else 0
same(x, np.array([want], dtype=np.int32), "exscan min (rank 0: the identity)")
# The classic use: each rank's offset into a global array from its local count.
count = np.array([rank % 3 + 1], dtype=np.int64)
offset = comm.exscan(count.copy(), op="sum")
same(offset, np.array([sum(k % 3 + 1 for k in range(rank))], dtype=np.int64), "exscan offsets")

comm.barrier()
print(f"TUTORIAL OK rank {rank} size {size} backend {comm.backend} checks {checks}", flush=True)
