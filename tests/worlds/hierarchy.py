"""All_reduce by host (spmd.comms.hierarchy), checked against the flat path in one launch of 2 hosts x 2 ranks;
broadcast down a chain and all_gather round a ring (spmd.comms.pipelined), against the plain results.

    hierarchy.py [--fake-hosts] [--bytes]

Checks, on every rank: the world groups its ranks by host at its first large all_reduce (ranks 0, 1
and 2, 3); the hierarchy's results equal the flat path's (a split of the whole world: flat, as every
sub-communicator is) bit for bit for int32 and int64 sum, max and min below, at and above
MIN_BYTES, and within rounding for float32 and float64 sums and avg; numpy and torch; the async form
(its work goes on while this rank computes); a list of arrays; chunk_bytes; DataParallel's buckets,
blocking and overlapped.  The chain and the ring (the world takes them: SPMD_PIPELINED auto on gloo across
hosts, or on): broadcast and all_gather of uint8, int32, float64 (numpy and torch), bfloat16, below, at
and above MIN_BYTES, from every root, with out=, uneven, non-contiguous, async, equal to the data every
rank made bit for bit.  Then, with --bytes,
the bytes out of this host's eth0 per 32 MiB all_reduce, spmd's (by host) against raw
torch.distributed.all_reduce on the same ranks (median of 3 each, interleaved); rank 0 prints
``BYTES {"hier": ..., "raw": ...}`` and every rank asserts hier <= 0.75 raw.  --fake-hosts makes
ranks 2r and 2r + 1 one host (one machine, for a test without the lab).  Rank 0 prints ``HIERARCHY
OK`` at the end.
"""

import json
import os
import statistics
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from spmd.comms import hierarchy  # noqa: E402

if "--fake-hosts" in sys.argv:
    hierarchy.host_key = lambda placement: f"fake {int(os.environ['PMI_RANK']) // 2}"

from spmd import comm  # noqa: E402

MIN = hierarchy.MIN_BYTES
flat = comm.split(0)  # every rank, in rank order: a sub-communicator, so flat
assert comm.size == 4 and flat._hierarchy is None, (comm.size, flat._hierarchy)
assert comm._hierarchy is not None, "the world should look for its hosts"
rng = np.random.default_rng(comm.rank)


def data(dtype, nbytes):
    n = max(1, nbytes // np.dtype(dtype).itemsize)
    if np.dtype(dtype).kind == "i":
        return rng.integers(-(1 << 28), 1 << 28, n, dtype=dtype)
    return rng.standard_normal(n).astype(dtype)


def both(x, op="sum", kind="numpy"):
    """x all_reduced by the world (hierarchy for large x) and by the flat communicator, as numpy."""
    a, b = x.copy(), x.copy()
    if kind == "torch":
        a, b = torch.from_numpy(a).clone(), torch.from_numpy(b).clone()
    comm.all_reduce(a, op)
    flat.all_reduce(b, op)
    return np.asarray(a), np.asarray(b)


# The first large one builds the grouping, on every rank together.
x, y = both(data(np.int64, MIN))
assert (x == y).all()
assert comm._hierarchy.hosts.groups == ((0, 1), (2, 3)), comm._hierarchy.hosts
assert not comm._hierarchy.flat

for dtype in (np.int32, np.int64):
    for nbytes in (MIN - 8, MIN, MIN + 4096, 4 * MIN):
        for op in ("sum", "max", "min"):
            for kind in ("numpy", "torch"):
                x, y = both(data(dtype, nbytes), op, kind)
                assert x.dtype == dtype and (x == y).all(), (dtype, nbytes, op, kind)
for dtype, tol in ((np.float32, 1e-5), (np.float64, 1e-12)):
    for nbytes in (MIN - 8, MIN, 4 * MIN):
        for op in ("sum", "avg", "max"):
            for kind in ("numpy", "torch"):
                x, y = both(data(dtype, nbytes), op, kind)
                exact = op == "max"
                assert (x == y).all() if exact else np.allclose(x, y, rtol=tol, atol=tol), (dtype, nbytes, op, kind)

# prod, exact on small integers
x, y = both(rng.integers(1, 3, MIN // 8, dtype=np.int64), "prod")
assert (x == y).all()

# async: the work goes on while this rank computes, then wait() gives x
t = torch.from_numpy(data(np.float32, 4 * MIN))
ref = t.clone()
flat.all_reduce(ref)
h = comm.all_reduce(t, async_op=True)
busy = sum(i * i for i in range(20000))
assert h.wait() is t and torch.allclose(t, ref, rtol=1e-5, atol=1e-5)
# several in flight, waited for in reverse order
ts = [torch.from_numpy(data(np.int32, 2 * MIN)) for _ in range(3)]
refs = [a.clone() for a in ts]
for a in refs:
    flat.all_reduce(a)
hs = [comm.all_reduce(a, async_op=True) for a in ts]
for hd in reversed(hs):
    hd.wait()
assert all(torch.equal(a, b) for a, b in zip(ts, refs))

# a list: one flat buffer per dtype, large enough to go by host
xs = [data(np.int64, MIN // 2), data(np.int64, MIN), data(np.float64, 3 * MIN)]
ys = [a.copy() for a in xs]
comm.all_reduce(xs)
flat.all_reduce(ys)
assert (xs[0] == ys[0]).all() and (xs[1] == ys[1]).all() and np.allclose(xs[2], ys[2], rtol=1e-12)
hl = comm.all_reduce([torch.from_numpy(a.copy()) for a in ys[:2]], async_op=True)
assert all((np.asarray(a) == b * 4).all() for a, b in zip(hl.wait(), ys[:2]))  # every rank held ys

# chunk_bytes: pieces of 2 MiB, each by host
x = data(np.int64, 8 * MIN)
y = x.copy()
comm.all_reduce(x, chunk_bytes=2 * MIN)
flat.all_reduce(y)
assert (x == y).all()

# DataParallel's buckets (2 MiB each), blocking and overlapped with backward: the world's (by host)
# gradients equal a flat communicator's within rounding
from spmd.train.data_parallel import DataParallel  # noqa: E402

ran = []
run = comm._hierarchy._run
comm._hierarchy._run = lambda x, op: (ran.append(op), run(x, op))
for overlap in (False, True):
    del ran[:]
    grads = []
    for c in (comm, flat):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.Linear(1024, 512))
        dp = DataParallel(model, c, bucket_mb=2, overlap=overlap)
        torch.manual_seed(1 + comm.rank)
        dp.backward(dp(torch.randn(8, 512)).square().sum())
        grads.append([p.grad.clone() for p in model.parameters()])
        dp.close()
    assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(*grads)), f"overlap={overlap}"
    assert len(ran) >= 2, f"overlap={overlap}: {len(ran)} buckets went by host"  # 4.2 MB in 2 MiB buckets
comm._hierarchy._run = run

# Broadcast down a chain and all_gather round a ring (spmd.comms.pipelined): the results a plain
# broadcast and all_gather give (a copy: bit for bit), every rank's data made from (case, rank) on every rank.
from spmd.comms import pipelined  # noqa: E402

PMIN, case = pipelined.MIN_BYTES, [0]
assert comm._pipelined is not None, "the world should take the chain and the ring"


def made(rank, dtype, count, cols=None):
    """Rank's data of case case[0]: the same on every rank that makes it."""
    g = np.random.default_rng((case[0], rank))
    raw = g.integers(0, 256, count * np.dtype(dtype).itemsize, dtype=np.uint8).view(dtype)
    return raw if cols is None else raw.reshape(-1, cols)


def as_kind(a, kind, dtype=None):
    t = torch.from_numpy(a.copy())
    return a.copy() if kind == "numpy" else (t.view(dtype) if dtype is not None else t)


for dtype in (np.uint8, np.int32, np.float64):
    size = np.dtype(dtype).itemsize
    for count in (PMIN // size // 4 - 1, PMIN // size - 1, PMIN // size, (3 * PMIN + 4099) // size):
        for kind in ("numpy", "torch"):
            case[0] += 1
            root = case[0] % comm.size
            x = as_kind(made(root, dtype, count) if comm.rank == root else np.zeros(count, dtype), kind)
            assert comm.broadcast(x, root) is x
            assert np.asarray(x).tobytes() == made(root, dtype, count).tobytes(), (dtype, count, kind, root)
            got = comm.all_gather(as_kind(made(comm.rank, dtype, count), kind))
            assert [np.asarray(g).tobytes() for g in got] == [made(r, dtype, count).tobytes() for r in range(4)]
            out = as_kind(np.empty(4 * count, dtype), kind)
            got = comm.all_gather(as_kind(made(comm.rank, dtype, count), kind), equal=True, out=out)
            assert np.asarray(out).tobytes() == b"".join(made(r, dtype, count).tobytes() for r in range(4))
            assert all(np.shares_memory(np.asarray(g), np.asarray(out)) for g in got)
assert comm._pipelined._stages is not None, "no broadcast or all_gather took the chain or the ring"

# bfloat16 (torch only), rows of several columns, uneven all_gather (rank r holds r + 1 blocks, rank 0 none
# at all in one case), a non-contiguous broadcast, async ones in flight together, waited for in reverse
case[0] += 1
x = made(2, np.int16, PMIN, 1024) if comm.rank == 2 else np.zeros((PMIN // 1024, 1024), np.int16)
t = torch.from_numpy(x.copy()).view(torch.bfloat16)
comm.broadcast(t, 2)
assert t.view(torch.int16).numpy().tobytes() == made(2, np.int16, PMIN, 1024).tobytes()
for first in (1, 0):
    case[0] += 1
    rows = lambda r: (r + first) * (PMIN // 128)  # noqa: E731  # 1.5 and 2.5 MIN_BYTES in all
    got = comm.all_gather(made(comm.rank, np.float32, rows(comm.rank) * 8, 8))
    assert [g.shape for g in got] == [(rows(r), 8) for r in range(4)]
    assert [g.tobytes() for g in got] == [made(r, np.float32, rows(r) * 8, 8).tobytes() for r in range(4)]
case[0] += 1
whole = torch.zeros(PMIN // 4, 2)
if comm.rank == 3:
    whole[:, 1] = torch.from_numpy(made(3, np.float32, PMIN // 4))
comm.broadcast(whole[:, 1], 3)
assert whole[:, 1].contiguous().numpy().tobytes() == made(3, np.float32, PMIN // 4).tobytes()
assert not whole[:, 0].any()
case[0] += 1
bs = [torch.from_numpy(made(1, np.int64, PMIN // 4) if comm.rank == 1 else np.zeros(PMIN // 4, np.int64))
      for _ in range(2)]
hs = [comm.broadcast(b, 1, async_op=True) for b in bs]
hg = comm.all_gather(torch.from_numpy(made(comm.rank, np.int64, PMIN // 8)), async_op=True)
busy = sum(i * i for i in range(20000))
assert [np.asarray(g).tobytes() for g in hg.wait()] == [made(r, np.int64, PMIN // 8).tobytes() for r in range(4)]
for b, hd in zip(reversed(bs), reversed(hs)):
    assert hd.wait() is b and b.numpy().tobytes() == made(1, np.int64, PMIN // 4).tobytes()

if "--bytes" in sys.argv:
    def out_bytes():
        with open("/sys/class/net/eth0/statistics/tx_bytes") as f:
            return int(f.read())

    def sent(fn):
        comm.barrier()
        before = out_bytes()
        fn()
        comm.barrier()
        return out_bytes() - before

    big = torch.ones(32 << 18)  # 32 MiB of float32
    hier, raw = [], []
    for _ in range(3):
        hier.append(sent(lambda: comm.all_reduce(big)))
        raw.append(sent(lambda: dist.all_reduce(big)))
    hier, raw = statistics.median(hier), statistics.median(raw)
    if comm.rank == 0:
        print("BYTES " + json.dumps({"hier": hier, "raw": raw}), flush=True)
    assert hier <= 0.75 * raw, f"rank {comm.rank}: {hier} B out of this host by host, {raw} B raw"

comm.barrier()
if comm.rank == 0:
    print("HIERARCHY OK", flush=True)
