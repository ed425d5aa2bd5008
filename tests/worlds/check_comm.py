"""Check every collective of spmd.comm at whatever size the launcher gave.

Expected values are computed from the world size, so one script serves
sizes 1, 2, 4 and 8 on every backend.  Each rank prints one line:
``CHECKS OK <n> rank <r> size <s> backend <b> launcher <l>``.
Usage: check_comm.py [--numpy-only]
"""

import os
import sys
import threading

import numpy as np

import spmd
from spmd import CollectiveError, comm

NUMPY_ONLY = "--numpy-only" in sys.argv
checks = 0


def ok(cond, what):
    global checks
    if not cond:
        raise AssertionError(f"rank {r}: {what}")
    checks += 1


def as_np(a):
    if isinstance(a, np.ndarray) or not hasattr(a, "numpy"):
        return np.asarray(a)
    return a.double().numpy() if a.is_floating_point() else a.numpy()


def same(a, b, what):
    ok(np.array_equal(as_np(a), as_np(b)), f"{what}: {a!r} != {b!r}")


r, n = comm.rank, comm.size
R = list(range(n))

# -- the kinds of array under test ------------------------------------------------
makers = [("numpy", np.float64), ("numpy", np.int32), ("numpy", np.float32)]
if not NUMPY_ONLY:
    import torch

    makers += [
        ("torch", torch.float32),
        ("torch", torch.float64),
        ("torch", torch.int64),
        ("torch", torch.int32),
        ("torch", torch.uint8),
        ("torch", torch.bfloat16),
        ("torch", torch.float16),
    ]


def make(kind, dtype, values):
    if kind == "numpy":
        return np.asarray(values, dtype=dtype)
    return torch.tensor(values, dtype=dtype)


def floating(kind, dtype):
    return np.issubdtype(dtype, np.floating) if kind == "numpy" else dtype.is_floating_point


for kind, dt in makers:
    tag = f"{kind} {dt}"
    # broadcast, every root
    for root in R:
        x = make(kind, dt, [[root + 1, 2], [3, 4]] if r == root else [[0, 0], [0, 0]])
        y = comm.broadcast(x, root=root)
        ok(y is x, f"broadcast returns its argument ({tag})")
        same(x, [[root + 1, 2], [3, 4]], f"broadcast root {root} ({tag})")
    # all_reduce with each op
    for op, expect in [
        ("sum", sum(k + 1 for k in R)),
        ("max", n),
        ("min", 1),
        ("prod", int(np.prod([k + 1 for k in R])) if n <= 4 else None),
    ]:
        if expect is None:
            continue
        x = make(kind, dt, [r + 1, r + 1, r + 1])
        comm.all_reduce(x, op=op)
        same(x, [expect] * 3, f"all_reduce {op} ({tag})")
    if floating(kind, dt):
        x = make(kind, dt, [2.0 * (r + 1)])
        comm.all_reduce(x, op="avg")
        same(x, [float(n + 1)], f"all_reduce avg ({tag})")
    # reduce: root holds the sum, the others keep their values
    for root in R:
        x = make(kind, dt, [r + 1, 1])
        comm.reduce(x, root=root)
        same(x, [sum(k + 1 for k in R), n] if r == root else [r + 1, 1], f"reduce root {root} ({tag})")

# -- the guide's examples, word for word in values ---------------------------------------
x = np.ones(1) * (r + 1)
comm.reduce(x, root=0)
if r == 0:
    same(x, [n * (n + 1) / 2], "guide reduce")

# scatter of one array, split like numpy.array_split, uneven rows
for rows in (n, 3 * n + 1, max(n - 1, 1), 0 if n > 1 else 1):
    full = np.arange(rows * 3, dtype=np.float32).reshape(rows, 3)
    mine = comm.scatter(full if r == 0 else None, root=0)
    expect = np.array_split(full, n)[r]
    ok(isinstance(mine, np.ndarray), "scatter returns the root's type (numpy)")
    same(mine, expect, f"scatter {rows} rows")
    back = comm.gather(mine * 2, root=0)
    if r == 0:
        same(np.concatenate(back), full * 2, f"gather {rows} rows")
        ok(len(back) == n, "gather returns one item per rank")
    else:
        ok(back is None, "gather returns None off root")
    everyone = comm.all_gather(mine + 1)
    same(np.concatenate(everyone), full + 1, f"all_gather {rows} rows")

# scatter of a list with a non-zero root, and the guide's scatter/gather
root = n - 1
chunks = [np.full((k + 1, 2), k, dtype=np.int64) for k in R] if r == root else None
mine = comm.scatter(chunks, root=root)
same(mine, np.full((r + 1, 2), r), "scatter list, uneven, root n-1")
got = comm.gather(np.array([float(r + 1)]) * 2, root=0)
if r == 0:
    ok([float(v[0]) for v in got] == [2.0 * (k + 1) for k in R], "guide gather")

if not NUMPY_ONLY:
    t = comm.scatter(torch.arange(2.0 * n).reshape(n, 2) if r == 0 else None)
    ok(isinstance(t, torch.Tensor), "scatter returns the root's type (torch)")
    same(t, [[2.0 * r, 2.0 * r + 1]], "scatter torch")
    lst = comm.all_gather(torch.tensor([r + 1.0]))
    same(torch.cat(lst), [k + 1.0 for k in R], "guide all_gather")
    # scatter of adjacent views of one tensor (sent without a copy) and of separate tensors
    whole = torch.arange(3.0 * (n * (n + 1) // 2)).reshape(-1, 3)
    views = list(whole.split([k + 1 for k in R])) if r == 0 else None
    same(comm.scatter(views), whole.split([k + 1 for k in R])[r], "scatter list of adjacent views")
    apart = [torch.full((k + 1, 3), float(k)) for k in R] if r == 0 else None
    same(comm.scatter(apart), torch.full((r + 1, 3), float(r)), "scatter list of separate tensors")
    # equal lengths take the plain collectives; results are views of one buffer
    even = comm.all_gather(torch.full((2, 3), float(r), dtype=torch.bfloat16))
    same(torch.stack(even).float(), [[[float(k)] * 3] * 2 for k in R], "all_gather even, bfloat16")
    g = comm.gather(torch.full((2, 3), r, dtype=torch.int32), root=n - 1)
    if r == n - 1:
        same(torch.stack(g), [[[k] * 3] * 2 for k in R], "gather even, root n-1")
    empty = comm.all_gather(torch.zeros(0, 3))
    ok(len(empty) == n and all(e.shape == (0, 3) for e in empty), "all_gather of empty tensors")
    empty = comm.gather(np.zeros((0, 2), np.float32))
    ok(empty is None if r else len(empty) == n and all(e.shape == (0, 2) for e in empty), "gather of empty arrays")
    # non-contiguous tensors are handled, results written back in place
    base = torch.zeros(3, 4)
    col = base[:, 1]
    col.fill_(r + 1)
    comm.all_reduce(col)
    same(base[:, 1], [sum(k + 1 for k in R)] * 3, "all_reduce non-contiguous")
    same(base[:, 0], [0.0] * 3, "all_reduce non-contiguous leaves neighbours")
    # contiguous on root, strided elsewhere: the ranks take different paths
    grid = torch.arange(6.0).reshape(2, 3) if r == 0 else torch.zeros(3, 2).t()
    comm.broadcast(grid)
    same(grid, [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]], "broadcast contiguous to strided")
    # bool data moves and reduces logically
    b = torch.tensor([r == 0, True])
    comm.broadcast(b, root=n - 1)
    same(b, [n == 1, True], "broadcast bool")
    # async overlap: start, compute, wait
    big = torch.full((1000,), float(r + 1))
    h = comm.all_reduce(big, async_op=True)
    _ = torch.randn(100, 100) @ torch.randn(100, 100)
    ok(h.wait() is big, "async all_reduce wait returns the tensor")
    ok(h.is_completed(), "handle completed after wait")
    same(big[:3], [n * (n + 1) / 2] * 3, "async all_reduce")
    h = comm.all_gather(torch.tensor([float(r)]), async_op=True)
    same(torch.cat(h.wait()), [float(k) for k in R], "async all_gather")
    h = comm.broadcast(torch.tensor([float(r)]), root=0, async_op=True)
    same(h.wait(), [0.0], "async broadcast")
    h = comm.reduce(torch.tensor([1.0]), root=0, async_op=True)
    same(h.wait(), [float(n)] if r == 0 else [1.0], "async reduce")
    h = comm.scatter([torch.tensor([k]) for k in R] if r == 0 else None, async_op=True)
    same(h.wait(), [r], "async scatter")
    h = comm.gather(torch.tensor([r]), root=0, async_op=True)
    res = h.wait()
    ok(res is None if r else [int(v) for v in res] == R, "async gather")
    h = comm.gather(torch.full((r + 1,), float(r)), root=n - 1, async_op=True)
    res = h.wait()
    ok(res is None if r != n - 1 else [p.tolist() for p in res] == [[float(k)] * (k + 1) for k in R],
       "async uneven gather")
    h = comm.scatter([torch.full((k + 1, 2), k) for k in R] if r == 0 else None, async_op=True)
    same(h.wait(), np.full((r + 1, 2), r), "async uneven scatter")
    # dtypes gloo's point-to-point and MPI's byte views must carry as they are
    for dt in (torch.complex64, torch.bool):
        x = (torch.ones(r + 1, 2) * (r + 1)).to(dt)
        g = comm.gather(x, root=0)
        if r == 0:
            ok(all(torch.equal(p, (torch.ones(k + 1, 2) * (k + 1)).to(dt)) for k, p in enumerate(g)), f"gather {dt}")
        got = comm.scatter([(torch.ones(k + 2, 3) * k).to(dt) for k in R] if r == 0 else None)
        ok(got.dtype == dt and torch.equal(got, (torch.ones(r + 2, 3) * r).to(dt)), f"scatter {dt}")

# -- coalesced and chunked all_reduce, large reduce ------------------------------
tensors = [np.full((k + 1, 3), float(r + k)) for k in range(5)] + [np.full(4, r, dtype=np.int64)]
ok(comm.all_reduce(tensors) is tensors, "coalesced all_reduce returns the list")
for k in range(5):
    same(tensors[k], np.full((k + 1, 3), float(sum(q + k for q in R))), f"coalesced all_reduce float {k}")
same(tensors[5], np.full(4, sum(R)), "coalesced all_reduce int64")
# The mpi backend packs a list in one MPI call; lists it cannot pack (a member
# twice, a strided member) take the copy loop: both must give the same sums.
twice = np.full(3, r + 1.0)
strided = np.full((4, 4), r + 1.0)[:, ::2]
comm.all_reduce([twice, twice, strided])
same(twice, [n * (n + 1) / 2] * 3, "coalesced all_reduce, one array twice")
same(strided, np.full((4, 2), n * (n + 1) / 2), "coalesced all_reduce, strided member")
arrays = [np.full((k + 1, 2), float(r + k)) for k in range(12)]  # one dtype: packed on mpi
comm.all_reduce(arrays, op="min")
ok(all(np.array_equal(a, np.full((k + 1, 2), float(k))) for k, a in enumerate(arrays)), "coalesced all_reduce, numpy, min")
if not NUMPY_ONLY:
    import torch

    ts = [torch.full((k + 1, 2), float(r + k)) for k in range(40)] + [torch.ones(0)]
    comm.all_reduce(ts, op="max")
    ok(all(torch.equal(t, torch.full((k + 1, 2), float(n - 1 + k))) for k, t in enumerate(ts[:40])),
       "coalesced all_reduce of 40 tensors, max")
h = comm.all_reduce([np.ones(3), np.ones(2, dtype=np.int32)], op="max", async_op=True)
same(h.wait()[1], [1, 1], "async coalesced all_reduce")
big = np.arange(100_000, dtype=np.float64) * (r + 1)
comm.all_reduce(big, chunk_bytes=64 * 1024)
same(big[[0, 1, 99_999]], [0.0, n * (n + 1) / 2, 99_999 * n * (n + 1) / 2], "chunked all_reduce")
strided = np.ones((1000, 8))[:, ::2] * (r + 1)
comm.all_reduce(strided, chunk_bytes=4096)
same(strided[999], [n * (n + 1) / 2] * 4, "chunked all_reduce, non-contiguous")
large = np.full(300_000, float(r + 1))  # past the reduce-by-allreduce size on mpi
comm.reduce(large, root=n - 1)
same(large[[0, -1]], [n * (n + 1) / 2] * 2 if r == n - 1 else [r + 1.0] * 2, "large reduce, others unchanged")
if comm.backend == "gloo":  # a reduce goes up a tree of sends, large ones in pieces: make pieces small
    import spmd.comms.backends.torchdist.gloo as gloo_backend

    saved, gloo_backend.PIECE_BYTES = gloo_backend.PIECE_BYTES, 4096
    try:
        for root in R:
            for op, want in [("sum", sum(k + 1 for k in R)), ("max", n), ("min", 1), ("prod", float(np.prod([k + 1 for k in R])))]:
                big = np.full(300_001, float(r + 1))  # 2.4 MB: four pieces, the last one short
                big[-1] = -1.0 if r == root else r + 1.0
                comm.reduce(big, root=root, op=op)
                last = {"sum": want - root - 2, "max": max([k + 1 for k in R if k != root] + [-1]),
                        "min": -1.0, "prod": -want / (root + 1)}[op] if n > 1 else -1.0
                same(big[[0, 150_000, -1]], [want, want, last] if r == root else [r + 1.0, r + 1.0, r + 1.0],
                     f"reduce {op} root {root} in pieces, others unchanged")
        h = comm.reduce(np.full(5, float(r + 1)), root=0, op="max", async_op=True)  # gloo's own reduce
        same(h.wait(), [float(n)] * 5 if r == 0 else [r + 1.0] * 5, "async reduce on gloo, others unchanged")
    finally:
        gloo_backend.PIECE_BYTES = saved
if comm.backend == "mpi":  # large blocking allreduces run in pieces; make pieces small to see them
    import spmd.comms.backends.mpi.backend as mpi_backend

    saved, mpi_backend.PIECE = mpi_backend.PIECE, 4096
    try:
        big = np.arange(300_001, dtype=np.float64) + r  # 2.4 MB: 586 pieces, the last one short
        comm.all_reduce(big)
        same(big[[0, 1, 511, 512, -1]], [n * k + sum(R) for k in (0, 1, 511, 512, 300_000)], "all_reduce in pieces")
        big = np.arange(300_001, dtype=np.float32) + r
        comm.reduce(big, root=0)
        want = [n * k + sum(R) for k in (0, 1023, 1024, 300_000)] if r == 0 else [k + r for k in (0, 1023, 1024, 300_000)]
        same(big[[0, 1023, 1024, -1]], want, "reduce in pieces, others unchanged")
        if not NUMPY_ONLY:
            t = torch.ones(300_001, dtype=torch.bfloat16)
            comm.all_reduce(t)
            same(t[[0, -1]].float(), [float(n)] * 2, "bfloat16 all_reduce in pieces")
    finally:
        mpi_backend.PIECE = saved

# -- large results are reused once dropped, never while held -----------------------
from spmd.comms.state.results import MIN_ITEMS  # noqa: E402

POOL = comm._caches.results  # the world's results pool

rows = MIN_ITEMS // 4 + 1  # each rank's (rows, 4): past the size the pool keeps
for kind in ["numpy"] + ([] if NUMPY_ONLY else ["torch"]):
    full = (lambda v: np.full((rows, 4), v)) if kind == "numpy" else (lambda v: torch.full((rows, 4), v))
    held = comm.all_gather(full(float(r)))  # kept by the pool, and held here
    # A view alone keeps the whole buffer; a detached one shares only the storage.
    view = held[-1][:1] if kind == "numpy" else held[-1].detach()[:1]
    del held
    for step in range(3):  # each step drops the last result as it assigns the next
        got = comm.all_gather(full(float(10 * step + r)))
        same(np.stack([as_np(g)[[0, -1]] for g in got]), [[[10.0 * step + k] * 4] * 2 for k in R],
             f"all_gather, result reused ({kind}, step {step})")
        same(view, [[float(n - 1)] * 4], f"a view of an earlier result stays as it was ({kind}, step {step})")
        mine = comm.scatter([full(float(k + step)) for k in R] if r == 0 else None)
        same(as_np(mine)[[0, -1]], [[float(r + step)] * 4] * 2, f"scatter, result reused ({kind}, step {step})")
        parts = comm.gather(full(float(r + step)), root=n - 1)
        if r == n - 1:
            same([as_np(p)[0, 0] for p in parts], [float(k + step) for k in R], f"gather, result reused ({kind})")
    again = comm.all_gather(full(-1.0))
    ok(all(as_np(g)[0, 0] == -1.0 for g in again) and as_np(got[0])[0, 0] == 20.0,
       f"a held result is never handed out again ({kind})")
    del got, again, parts, mine, view
ok(comm.backend == "serial" or 0 < POOL.nbytes <= POOL.limit, f"the pool keeps results within its limit ({POOL.nbytes} bytes)")

# -- objects -------------------------------------------------------------
ok(comm.broadcast_object({"a": [1, 2]} if r == 0 else None) == {"a": [1, 2]}, "broadcast_object")
g = comm.gather_object(("rank", r), root=0)
ok(g == [("rank", k) for k in R] if r == 0 else g is None, "gather_object")
ok(comm.all_gather_object(r * r) == [k * k for k in R], "all_gather_object")
ok(comm.scatter_object([f"item{k}" for k in R] if r == 0 else None) == f"item{r}", "scatter_object")

# -- sub-communicators ----------------------------------------------------------
half = comm.split(color=r % 2, key=-r)
members = [k for k in R if k % 2 == r % 2]
ok(half.size == len(members), "split size")
ok(half.rank == sorted(members, reverse=True).index(r), "split rank ordered by key")
x = np.array([r + 1.0])
half.all_reduce(x)
same(x, [sum(k + 1 for k in members)], "split all_reduce")
ok(half.all_gather_object(r) == sorted(members, reverse=True), "split all_gather_object")
y = half.broadcast(np.array([float(r)]), root=0)
same(y, [float(max(members))], "split broadcast root is group rank 0")
firsts = comm.split(ranks=[0])
ok((firsts is not None) == (r == 0), "split by ranks: members only")
if firsts is not None:
    ok(firsts.size == 1 and firsts.rank == 0, "split by ranks: size and rank")
none = comm.split(color=None if r else 0)
ok((none is None) == (r != 0), "split color None gives None")

# -- bad input: the same clear error on every rank, no hang ---------------------------------
def raises(fn, words, what):
    try:
        fn()
    except CollectiveError as exc:
        ok(all(w in str(exc) for w in words), f"{what}: message {exc}")
        return
    raise AssertionError(f"rank {r}: {what} did not raise")


# -- point to point: rings, any source, immediate forms, objects ----------------------
right, left = (r + 1) % n, (r - 1) % n
got = comm.sendrecv(np.full(3, r, np.int64), right, left, tag=5)
same(got, [left] * 3, "sendrecv ring")
if r == 0:
    senders = sorted(comm.recv(tag=2, status=True)[1] for _ in range(n - 1))
    ok(senders == R[1:], f"recv from any source hears every rank: {senders}")
elif not NUMPY_ONLY:
    comm.send(torch.full((2, 2), float(r)), 0, tag=2)
else:
    comm.send(np.full((2, 2), float(r)), 0, tag=2)
big = np.full(1 << 18, r, np.float32)  # 1 MiB: past every eager limit
h = comm.irecv(left, 9)
s = comm.isend(big, right, 9)
s.wait()  # the send first: the pending receive must progress meanwhile
got = h.wait()
ok(h.source == left and h.tag == 9 and got.dtype == np.float32 and got.shape == big.shape and got[0] == left,
   "isend/irecv of 1 MiB around the ring")
comm.send(np.arange(4.0) + r, right, 6)  # small blocking sends first, then receives (eager)
same(comm.recv(left, 6), np.arange(4.0) + left, "blocking ring of small sends")
comm.send_object({"from": r, "list": list(range(r))}, right, 3)
ok(comm.recv_object(left, 3) == {"from": left, "list": list(range(left))}, "send_object ring")
out = np.empty(3)
if n > 1:
    if r == 0:
        comm.send(np.zeros(4), 1, tag=8)
    elif r == 1:
        raises(lambda: comm.recv(0, 8, out=out), ["out is a float64 array of shape (3,)", "sent float64 of shape (4,)"],
               "recv into an out of the wrong shape")
    comm.send(np.full(2, r), right, 4)
    same(comm.recv(left, 4), [left] * 2, "the tag still matches after a refused receive")
# Around the size that travels inside the header's message on mpi (4000 B), into out and not,
# numpy and torch, contiguous out or not; then an out of the right size but the wrong dtype.
# Blocking sends past MPI's eager limit: even ranks send first, odd ones receive first.
def exchange(x, out=None):
    if r % 2 == 0:
        comm.send(x, right, 7)
        return comm.recv(left, 7, out=out)
    got = comm.recv(left, 7, out=out)
    comm.send(x, right, 7)
    return got


for count in (1, 499, 500, 501, 1025):
    for kind in ("numpy",) if NUMPY_ONLY else ("numpy", "torch"):
        mk = np if kind == "numpy" else torch
        x = mk.arange(count, dtype=mk.float64) + r * 1000
        expect = np.arange(count * 1.0) + left * 1000
        same(exchange(x), expect, f"recv of {count * 8} B ({kind})")
        out = mk.zeros(count, dtype=mk.float64)
        ok(exchange(x, out) is out, f"recv into out returns out ({count * 8} B, {kind})")
        same(out, expect, f"recv into out of {count * 8} B ({kind})")
        strided = mk.zeros(2 * count, dtype=mk.float64)[::2]
        exchange(x, strided)
        same(strided, expect, f"recv into a non-contiguous out of {count * 8} B ({kind})")
comm.send(np.arange(4, dtype=np.int64), right, 7)
raises(lambda: comm.recv(left, 7, out=np.empty(4)), ["out is a float64 array of shape (4,)", "sent int64 of shape (4,)"],
       "recv into an out of another dtype, the same size")
comm.send(np.full(2, r), right, 7)
same(comm.recv(left, 7), [left] * 2, "the tag still matches after a refused inline receive")
# -- all_to_all, reduce_scatter, scans --------------------------------------------------
chunks = [np.full((j + 1, 2), r * 10 + j) for j in R]
got = comm.all_to_all(chunks)
ok([c.shape[0] for c in got] == [r + 1] * n and all((got[i] == i * 10 + r).all() for i in R), "all_to_all uneven")
got = comm.all_to_all(np.arange(n * 2.0) + 100 * r, equal=True)
ok(all(got[i].tolist() == [100.0 * i + 2 * r, 100.0 * i + 2 * r + 1] for i in R), "all_to_all equal")
whole = np.arange(2 * n * 3.0).reshape(2 * n, 3) + r
mine = comm.reduce_scatter(whole)
same(mine, (np.arange(2 * n * 3.0).reshape(2 * n, 3)[2 * r : 2 * r + 2]) * n + sum(R), "reduce_scatter")
uneven = np.ones((n + 1, 2))
ok(comm.reduce_scatter(uneven).shape[0] == np.array_split(uneven, n)[r].shape[0], "reduce_scatter uneven blocks")
x = np.array([r + 1.0])
same(comm.scan(x), [sum(k + 1 for k in R[: r + 1])], "scan sum")
y = np.array([r + 1])
same(comm.exscan(y, "prod"), [int(np.prod([k + 1 for k in R[:r]]))], "exscan prod (rank 0: 1)")
z = np.array([float(r)])
same(comm.exscan(z, "max"), [r - 1.0 if r else -np.inf], "exscan max (rank 0: -inf)")
if not NUMPY_ONLY:
    t = torch.tensor([float(r), 1.0], dtype=torch.bfloat16)
    same(comm.scan(t, "sum"), [float(sum(R[: r + 1])), float(r + 1)], "scan bfloat16")
    same(comm.reduce_scatter(torch.ones(n, 2, dtype=torch.int32)), [[n, n]], "reduce_scatter torch int32")

# -- equal=True (no description exchange) and out= (receive into a given array) ----------
for kind in ("numpy",) if NUMPY_ONLY else ("numpy", "torch"):
    mk = np if kind == "numpy" else torch
    x = mk.ones((2, 3)) * (r + 1)
    expect = [[[k + 1.0] * 3] * 2 for k in R]
    same(np.stack([as_np(a) for a in comm.all_gather(x, equal=True)]), expect, f"all_gather equal {kind}")
    buf = mk.zeros((2 * n, 3))
    got = comm.all_gather(x, equal=True, out=buf)
    same(buf.reshape(n, 2, 3), expect, f"all_gather out= fills out ({kind})")
    got[0][0, 0] = -1.0
    ok(float(buf[0, 0]) == -1.0, f"all_gather out= returns views of out ({kind})")
    uneven = mk.ones((r + 1, 3)) * r
    buf = mk.zeros((n * (n + 1) // 2, 3))
    comm.all_gather(uneven, out=buf)
    same(buf, np.concatenate([np.full((k + 1, 3), float(k)) for k in R]), f"all_gather uneven into out ({kind})")
    buf = mk.zeros((2 * n, 3)) if r == n - 1 else None
    got = comm.gather(x, root=n - 1, equal=True, out=buf)
    if r == n - 1:
        same(buf.reshape(n, 2, 3), expect, f"gather equal out= ({kind})")
    else:
        ok(got is None, "gather equal off root")
    whole = mk.arange(6.0 * n).reshape(2 * n, 3)
    mine = mk.zeros((2, 3))
    back = comm.scatter(whole if r == 0 else None, equal=True, out=mine)
    ok(back is mine, f"scatter equal returns out ({kind})")
    same(mine, as_np(whole)[2 * r : 2 * r + 2], f"scatter equal out= ({kind})")
    mine = mk.zeros((r + 1, 3))
    chunks = [mk.ones((k + 1, 3)) * k for k in R] if r == 0 else None
    same(comm.scatter(chunks, out=mine), np.full((r + 1, 3), float(r)), f"scatter uneven into out ({kind})")
    raises(lambda: comm.all_gather(x, out=mk.zeros((n, 3))), ["out must be", f"shape ({2 * n}, 3)"], "all_gather bad out")

raises(lambda: comm.scatter([np.zeros(1)] * (n + 1) if r == 0 else None), [f"expecting {n} chunks"], "scatter wrong length")
if n > 1:
    mixed = [np.zeros(1)] * (n - 1) + [np.zeros(2, dtype=np.int8)]
    raises(lambda: comm.scatter(mixed if r == 0 else None), ["dtype"], "scatter mixed dtypes")
raises(lambda: comm.broadcast(np.zeros(1), root=n), ["root", "out of range"], "root out of range")
raises(lambda: comm.all_reduce(np.zeros(1), op="median"), ["unknown reduction op"], "unknown op")
raises(lambda: comm.all_reduce(np.zeros(1, dtype=np.int64), op="avg"), ["floating"], "avg on integers")
raises(lambda: comm.all_reduce([1, 2]), ["numpy.ndarray"], "list input")
if n > 1:
    raises(lambda: comm.gather(np.zeros((1, r + 1))), ["same shape after dim 0"], "gather trailing shapes differ")
comm.barrier()
backend, launcher = comm.backend, comm.launcher
caches = comm._caches


def thread_names():
    names = []
    for t in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{t}/comm") as f:
                names.append(f.read().strip())
        except OSError:  # a thread that ended meanwhile (ENOENT or ESRCH)
            pass
    return names


# finalize stops torch's gloo worker threads even while sub-communicators
# (half, firsts) are still referenced: a worker that outlives it can free a
# tensor during interpreter teardown and abort the process at exit.
spmd.finalize()
# finalize lets go of everything the communicators kept (spmd.comms.state.caches)
ok(caches.nbytes == 0 and len(caches.flat) == 0 and len(caches.layouts) == 0,
   f"caches cleared at finalize ({caches.nbytes} bytes, {len(caches.flat)} flat, {len(caches.layouts)} layouts)")
# The timeout watcher has ended too: a daemon thread left holding the
# communicator frees its tensors during interpreter teardown, and aborts.
ok(not [t for t in threading.enumerate() if t.name == "spmd-timeout"], "timeout thread ended at finalize")
if os.path.isdir("/proc/self/task"):
    left = [t for t in thread_names() if t.startswith("pt_gloo")]
    ok(not left, f"no gloo worker thread after finalize, found {left}")
print(f"CHECKS OK {checks} rank {r} size {n} backend {backend} launcher {launcher}", flush=True)
