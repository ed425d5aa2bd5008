"""What each implementation runs for each collective, on float32 buffers.

A case is built once per collective, implementation and layout, with
its buffers allocated up front, so the timed call is only the call.
spmd and raw gloo get torch tensors (allocated by torch); raw mpi4py
gets numpy arrays, its own documented buffer API.  The spmd calls are
the public ones, in place where spmd is in place; the raw calls are the
plain documented ones doing the same operation (in place where MPI
allows it, ``MPI.IN_PLACE`` being what spmd's semantics ask for).

Built with ``fill=True`` the buffers hold rank-dependent values and
``result()`` returns what this rank ends up with, so each case can be
checked before it is timed.
"""

from dataclasses import dataclass

import numpy as np

from spmd.comms.arrays import is_tensor
from spmd.errors import BenchArgumentError
from spmd.util.bandwidth import bus_factor

__all__ = [
    "COLLECTIVES",
    "EXTRAS",
    "MESSAGES",
    "ALL",
    "BUSBW",
    "Layout",
    "Case",
    "EQUAL_FORM",
    "impls_for",
    "build",
    "expected",
]

#: The six collectives, in table order.
COLLECTIVES = ("broadcast", "reduce", "all_reduce", "scatter", "gather", "all_gather")
#: Further measurements: uneven chunks, a list of small tensors.
EXTRAS = ("scatter_uneven", "gather_uneven", "all_reduce_many")
#: Point to point and the later collectives, asked for with --collectives: a
#: ping-pong between ranks 0 and 1 (time of the round trip), a ring sendrecv,
#: all_to_all and reduce_scatter of equal blocks.
MESSAGES = ("pingpong", "sendrecv", "all_to_all", "reduce_scatter")
ALL = COLLECTIVES + EXTRAS + MESSAGES

ROOT = 0
#: Collectives also timed in spmd's equal=True, out= form ("+equal"): same shape
#: on every rank declared, so no description exchange, and a receive buffer given.
EQUAL_FORM = ("scatter", "gather", "all_gather", "all_to_all")


#: busbw = algbw * BUSBW(collective, ranks), as nccl-tests computes it (the trace's table too).
BUSBW = bus_factor


@dataclass(frozen=True)
class Layout:
    """Element counts: per-rank chunk lengths (data movement), else one buffer's length.

    For all_reduce_many, ``elems`` is each tensor's length and ``count``
    the number of tensors.
    """

    elems: int = 0
    lengths: tuple = ()
    count: int = 1

    @property
    def nbytes(self):
        """The bytes nccl-tests calls S: one buffer, or the whole gathered array."""
        return 4 * (sum(self.lengths) if self.lengths else self.elems * self.count)


@dataclass
class Case:
    """A ready-to-time collective: ``op()`` runs it once, ``result()`` reads this rank's result."""

    op: object
    result: object
    buffer: object = None  # the data buffer, for the huge-page probe


def impls_for(collective, world_impls):
    """Return the implementations measured for collective, in table order."""
    out = []
    for name in world_impls:
        if collective.endswith("_uneven") and name == "gloo":
            continue  # torch.distributed's scatter and gather need equal sizes
        out.append(name)
        if collective == "all_reduce_many":
            out.append(name + "+coalesce")
        if collective in EQUAL_FORM and name.startswith("spmd-"):
            out.append(name + "+equal")
        if collective in ("pingpong", "sendrecv") and name == "mpi4py":
            out.append("mpi4py+pickle")  # mpi4py's own messages that carry dtype and shape
    return tuple(out)


# -- buffers -----------------------------------------------------------------------


def _buf(kind, n, values=None):
    """Return a float32 buffer of n elements, allocated by numpy or by torch.

    kind "torchbuf" is torch's memory seen as a numpy array, for raw
    mpi4py on torch-allocated buffers (the huge-page comparison).
    """
    if kind == "torchbuf":
        return _buf("torch", n, values).numpy()
    if kind == "numpy":
        # Written, not np.zeros: calloc'ed pages nobody wrote all map the one zero page,
        # and sending from them reads the same 4 KiB over and over, unrealistically fast.
        a = np.empty(n, np.float32)
        a[...] = 0 if values is None else values
        return a
    import torch

    t = torch.zeros(n, dtype=torch.float32)
    if values is not None:
        t.copy_(torch.from_numpy(np.asarray(values, np.float32)))
    return t


def _np(x):
    """Return a flat float64 numpy copy of an array, a tensor or a list of either."""
    if x is None:
        return None
    if isinstance(x, (list, tuple)):
        return np.concatenate([_np(p) for p in x]) if x else np.zeros(0)
    if is_tensor(x):
        x = x.detach().numpy()
    return np.asarray(x, np.float64).reshape(-1)


def _kind(impl):
    if impl == "mpi4py-torchbuf":
        return "torchbuf"
    return "numpy" if impl.startswith("mpi4py") else "torch"


def _spmd(world, impl):
    return world.spmd_mpi if impl.startswith("spmd-mpi") else world.spmd_gloo


def _offsets(lengths):
    return [sum(lengths[:i]) for i in range(len(lengths))]


# -- the collectives ---------------------------------------------------------------


def _broadcast(world, impl, layout, fill):
    n, rank = layout.elems, world.rank
    x = _buf(_kind(impl), n, np.arange(1, n + 1) if fill and rank == ROOT else None)
    if impl.startswith("mpi4py"):
        return Case(lambda: world.mpi.Bcast(x, ROOT), lambda: x, x)
    if impl == "gloo":
        import torch.distributed as dist

        return Case(lambda: dist.broadcast(x, src=ROOT), lambda: x, x)
    comm = _spmd(world, impl)
    return Case(lambda: comm.broadcast(x, ROOT), lambda: x, x)


def _reduction(world, impl, layout, fill, rooted):
    n, rank = layout.elems, world.rank
    x = _buf(_kind(impl), n, np.full(n, rank + 1) if fill else None)
    mine = (lambda: x) if not rooted or rank == ROOT else (lambda: None)
    if impl.startswith("mpi4py"):
        from mpi4py import MPI

        c = world.mpi
        if not rooted:
            return Case(lambda: c.Allreduce(MPI.IN_PLACE, x, MPI.SUM), mine, x)
        if rank == ROOT:
            return Case(lambda: c.Reduce(MPI.IN_PLACE, x, MPI.SUM, ROOT), mine, x)
        return Case(lambda: c.Reduce(x, None, MPI.SUM, ROOT), mine, x)
    if impl == "gloo":
        import torch.distributed as dist

        if rooted:
            return Case(lambda: dist.reduce(x, dst=ROOT), mine, x)
        return Case(lambda: dist.all_reduce(x), mine, x)
    comm = _spmd(world, impl)
    if rooted:
        return Case(lambda: comm.reduce(x, ROOT), mine, x)
    return Case(lambda: comm.all_reduce(x), mine, x)


def _scatter(world, impl, layout, fill, even):
    lengths, rank = list(layout.lengths), world.rank
    total, kind = sum(lengths), _kind(impl)
    whole = None
    if rank == ROOT:
        whole = _buf(kind, total, np.arange(1, total + 1) if fill else None)
    box = [None]
    if impl.startswith("mpi4py"):
        from mpi4py import MPI

        out = _buf(kind, lengths[rank])
        c = world.mpi
        if even:
            op = lambda: c.Scatter(whole, out, ROOT)  # noqa: E731
        else:
            send = None
            if rank == ROOT:
                send = [whole, lengths, _offsets(lengths), MPI.FLOAT]
            op = lambda: c.Scatterv(send, out, ROOT)  # noqa: E731
        return Case(op, lambda: out)
    if impl == "gloo":
        import torch.distributed as dist

        out = _buf(kind, lengths[rank])
        parts = list(whole.split(lengths)) if rank == ROOT else None
        return Case(lambda: dist.scatter(out, parts, src=ROOT), lambda: out)
    comm = _spmd(world, impl)
    if impl.endswith("+equal"):
        out = _buf(kind, lengths[rank])
        return Case(lambda: comm.scatter(whole, ROOT, equal=True, out=out), lambda: out)
    # Even: the whole tensor, split by spmd; uneven: the list of chunks.
    chunks = whole if even or rank != ROOT else list(whole.split(lengths))

    def op():
        box[0] = comm.scatter(chunks, ROOT)

    return Case(op, lambda: box[0])


def _gather(world, impl, layout, fill, everyone, even):
    lengths, rank = list(layout.lengths), world.rank
    total, kind = sum(lengths), _kind(impl)
    x = _buf(kind, lengths[rank], np.full(lengths[rank], rank + 1) if fill else None)
    receives = everyone or rank == ROOT
    box = [None]
    if impl.startswith("mpi4py"):
        from mpi4py import MPI

        c = world.mpi
        recv = _buf(kind, total) if receives else None
        mine = lambda: recv  # noqa: E731
        if everyone:
            return Case(lambda: c.Allgather(x, recv), mine)
        if even:
            return Case(lambda: c.Gather(x, recv, ROOT), mine)
        spec = [recv, lengths, _offsets(lengths), MPI.FLOAT] if receives else None
        return Case(lambda: c.Gatherv(x, spec, ROOT), mine)
    if impl == "gloo":
        import torch.distributed as dist

        recv = _buf(kind, total) if receives else None
        parts = list(recv.split(lengths)) if receives else None
        if everyone:
            return Case(lambda: dist.all_gather(parts, x), lambda: recv)
        return Case(lambda: dist.gather(x, parts, dst=ROOT), lambda: recv)
    comm = _spmd(world, impl)
    if impl.endswith("+equal"):
        recv = _buf(kind, total) if receives else None
        if everyone:
            return Case(lambda: comm.all_gather(x, equal=True, out=recv), lambda: recv)
        return Case(lambda: comm.gather(x, ROOT, equal=True, out=recv), lambda: recv)
    if everyone:

        def op():
            box[0] = comm.all_gather(x)

    else:

        def op():
            box[0] = comm.gather(x, ROOT)

    return Case(op, lambda: box[0])


def _many(world, impl, layout, fill):
    n, rank = layout.elems, world.rank
    base, coalesce = impl.split("+")[0], impl.endswith("+coalesce")
    xs = [_buf(_kind(base), n, np.full(n, rank + 1) if fill else None) for _ in range(layout.count)]
    mine = lambda: xs  # noqa: E731
    if base.startswith("mpi4py"):  # also mpi4py-torchbuf
        from mpi4py import MPI

        c = world.mpi
        if not coalesce:
            return Case(lambda: [c.Allreduce(MPI.IN_PLACE, a, MPI.SUM) for a in xs], mine)
        return Case(lambda: _coalesced(lambda f: c.Allreduce(MPI.IN_PLACE, f, MPI.SUM), xs), mine)
    if base == "gloo":
        import torch.distributed as dist

        if not coalesce:
            return Case(lambda: [dist.all_reduce(t) for t in xs], mine)
        return Case(lambda: _coalesced(dist.all_reduce, xs), mine)
    comm = _spmd(world, base)
    if not coalesce:
        return Case(lambda: [comm.all_reduce(t) for t in xs], mine)
    return Case(lambda: comm.all_reduce(xs), mine)  # spmd's list form: one call per dtype


def _message(world, impl, layout, fill, pingpong):
    """pingpong: rank 0 sends, rank 1 sends it back (others idle); sendrecv: a ring, every rank at once."""
    n, rank, size = layout.elems, world.rank, world.size
    kind = _kind(impl)
    if pingpong:
        x = _buf(kind, n, np.arange(1, n + 1) if fill and rank == 0 else None)
        if rank > 1:
            return Case(lambda: None, lambda: None)
        peer, first = 1 - rank, rank == 0
    else:
        x = _buf(kind, n, np.full(n, rank + 1) if fill else None)
        right, left = (rank + 1) % size, (rank - 1) % size
    y = _buf(kind, n)
    if impl == "mpi4py+pickle":  # send/recv of the array object: what spmd's messages also do
        c, box = world.mpi, [y]
        if not pingpong:
            return Case(lambda: box.__setitem__(0, c.sendrecv(x, right, 0, None, left, 0)), lambda: box[0])
        if first:
            return Case(lambda: (c.send(x, peer, 0), box.__setitem__(0, c.recv(None, peer, 0))), lambda: box[0])
        return Case(lambda: (box.__setitem__(0, c.recv(None, peer, 0)), c.send(box[0], peer, 0)), lambda: box[0])
    if impl.startswith("mpi4py"):
        c = world.mpi
        if not pingpong:
            return Case(lambda: c.Sendrecv(x, right, 0, y, left, 0), lambda: y)
        if first:
            return Case(lambda: (c.Send(x, peer, 0), c.Recv(y, peer, 0)), lambda: y)
        return Case(lambda: (c.Recv(y, peer, 0), c.Send(y, peer, 0)), lambda: y)
    if impl == "gloo":
        import torch.distributed as dist

        if not pingpong:
            def ring():
                works = [dist.isend(x, right), dist.irecv(y, left)]
                for w in works:
                    w.wait()
            return Case(ring, lambda: y)
        if first:
            return Case(lambda: (dist.send(x, peer), dist.recv(y, peer)), lambda: y)
        return Case(lambda: (dist.recv(y, peer), dist.send(y, peer)), lambda: y)
    comm = _spmd(world, impl)
    if not pingpong:
        return Case(lambda: comm.sendrecv(x, right, left, out=y), lambda: y)
    if first:
        return Case(lambda: (comm.send(x, peer), comm.recv(peer, out=y)), lambda: y)
    return Case(lambda: (comm.recv(peer, out=y), comm.send(y, peer)), lambda: y)


def _all_to_all(world, impl, layout, fill):
    lengths, rank = list(layout.lengths), world.rank
    total, kind = sum(lengths), _kind(impl)
    x = _buf(kind, total, np.full(total, rank + 1) if fill else None)
    y = _buf(kind, total)
    box = [None]
    if impl.startswith("mpi4py"):
        return Case(lambda: world.mpi.Alltoall(x, y), lambda: y)
    if impl == "gloo":
        import torch.distributed as dist

        return Case(lambda: dist.all_to_all_single(y, x), lambda: y)
    comm = _spmd(world, impl)
    if impl.endswith("+equal"):
        return Case(lambda: comm.all_to_all(x, equal=True, out=y), lambda: y)

    def op():
        box[0] = comm.all_to_all(x)

    return Case(op, lambda: box[0])


def _reduce_scatter(world, impl, layout, fill):
    lengths, rank = list(layout.lengths), world.rank
    total, kind = sum(lengths), _kind(impl)
    x = _buf(kind, total, np.full(total, rank + 1) if fill else None)
    box = [None]
    if impl.startswith("mpi4py"):
        from mpi4py import MPI

        y = _buf(kind, lengths[rank])
        return Case(lambda: world.mpi.Reduce_scatter_block(x, y, MPI.SUM), lambda: y)
    if impl == "gloo":
        from spmd.comms.backends.torchdist.arrays import reduce_scatter_single

        y = _buf(kind, lengths[rank])
        return Case(lambda: reduce_scatter_single(y, x), lambda: y)
    comm = _spmd(world, impl)

    def op():
        box[0] = comm.reduce_scatter(x)

    return Case(op, lambda: box[0])


def build(world, collective, impl, layout, fill=False):
    """Return the Case for collective on impl with layout's buffers.

    impl is one of ``impls_for(collective, ...)``, which leaves out what an
    implementation cannot do (raw gloo's uneven scatter and gather).
    """
    if collective == "broadcast":
        return _broadcast(world, impl, layout, fill)
    if collective in ("reduce", "all_reduce"):
        return _reduction(world, impl, layout, fill, collective == "reduce")
    if collective in ("scatter", "scatter_uneven"):
        return _scatter(world, impl, layout, fill, collective == "scatter")
    if collective in ("gather", "gather_uneven", "all_gather"):
        return _gather(world, impl, layout, fill, collective == "all_gather", collective != "gather_uneven")
    if collective == "all_reduce_many":
        return _many(world, impl, layout, fill)
    if collective in ("pingpong", "sendrecv"):
        return _message(world, impl, layout, fill, collective == "pingpong")
    if collective == "all_to_all":
        return _all_to_all(world, impl, layout, fill)
    if collective == "reduce_scatter":
        return _reduce_scatter(world, impl, layout, fill)
    raise BenchArgumentError(f"unknown collective {collective!r}")


def expected(collective, layout, rank, size):
    """Return what rank must hold after a filled case ran (flat float64), or None."""
    n = layout.elems
    total = sum(layout.lengths)
    if collective == "broadcast":
        return np.arange(1, n + 1, dtype=np.float64)
    if collective.startswith("all_reduce") or (collective == "reduce" and rank == ROOT):
        return np.full(n * layout.count, size * (size + 1) / 2)
    if collective.startswith("scatter"):
        start = sum(layout.lengths[:rank])
        return np.arange(start + 1, start + layout.lengths[rank] + 1, dtype=np.float64)
    if collective == "pingpong":
        return np.arange(1, n + 1, dtype=np.float64) if rank < 2 else None
    if collective == "sendrecv":
        return np.full(n, (rank - 1) % size + 1.0)
    if collective == "all_to_all":
        return np.concatenate([np.full(m, r + 1.0) for r, m in enumerate(layout.lengths)])
    if collective == "reduce_scatter":
        return np.full(layout.lengths[rank], size * (size + 1) / 2)
    if collective == "all_gather" or (collective.startswith("gather") and rank == ROOT):
        return np.concatenate([np.full(m, r + 1.0) for r, m in enumerate(layout.lengths)]) if total else None
    return None


def check(case, collective, layout, rank, size, impl):
    """Raise AssertionError unless case's result is what collective must give."""
    want = expected(collective, layout, rank, size)
    got = _np(case.result())
    if want is None:
        return
    if got is None or got.shape != want.shape or not np.allclose(got, want):
        raise AssertionError(
            f"{impl} {collective} gave a wrong result on rank {rank}: expected {want[:8]}..., "
            f"got {None if got is None else got[:8]}..."
        )


# -- many small tensors ---------------------------------------------------------------


def _coalesced(reduce_flat, xs):
    """Flatten same-dtype xs into one buffer, reduce it with reduce_flat, copy back.

    What raw mpi4py and raw gloo users write by hand (torch's own
    all_reduce_coalesced is deprecated); spmd's is ``comm.all_reduce(list)``.
    """
    groups = {}
    for x in xs:
        groups.setdefault((is_tensor(x), str(x.dtype)), []).append(x)
    for (tensor, _), parts in groups.items():
        if tensor:
            import torch

            flat = torch.cat([p.reshape(-1) for p in parts])
        else:
            flat = np.concatenate([p.reshape(-1) for p in parts])
        reduce_flat(flat)
        offset = 0
        for p in parts:
            count = p.numel() if tensor else p.size
            piece = flat[offset : offset + count].reshape(p.shape)
            if tensor:
                p.copy_(piece)
            else:
                np.copyto(p, piece)
            offset += count
    return xs
