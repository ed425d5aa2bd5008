"""How each implementation runs each collective: its buffers, allocated up front, and the call.

spmd and raw gloo get torch tensors (allocated by torch); raw mpi4py gets numpy
arrays, its own documented buffer API.  The spmd calls are the public ones, in
place where spmd is in place; the raw calls are the plain documented ones doing
the same operation (in place where MPI allows it).  With ``fill=True`` buffers
hold rank-dependent values, so each case can be checked before it is timed.
"""

import numpy as np

from spmd.bench.layout import ROOT, Case
from spmd.comms.arrays import is_tensor

__all__ = ["buffer", "flat64", "broadcast", "reduction", "scatter", "gather", "many", "message",
           "all_to_all", "reduce_scatter", "coalesced"]

# -- buffers -----------------------------------------------------------------------


def buffer(kind, n, values=None):
    """Return a float32 buffer of n elements, allocated by numpy or by torch.

    kind "torchbuf" is torch's memory seen as a numpy array, for raw
    mpi4py on torch-allocated buffers (the huge-page comparison).
    """
    if kind == "torchbuf":
        return buffer("torch", n, values).numpy()
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


def flat64(x):
    """Return a flat float64 numpy copy of an array, a tensor or a list of either."""
    if x is None:
        return None
    if isinstance(x, (list, tuple)):
        return np.concatenate([flat64(p) for p in x]) if x else np.zeros(0)
    if is_tensor(x):
        x = x.detach().numpy()
    return np.asarray(x, np.float64).reshape(-1)


def kind_of(impl):
    if impl == "mpi4py-torchbuf":
        return "torchbuf"
    return "numpy" if impl.startswith("mpi4py") else "torch"


def spmd_of(world, impl):
    return world.spmd_mpi if impl.startswith("spmd-mpi") else world.spmd_gloo


def offsets(lengths):
    return [sum(lengths[:i]) for i in range(len(lengths))]

# -- the collectives ---------------------------------------------------------------


def broadcast(world, impl, layout, fill):
    n, rank = layout.elems, world.rank
    x = buffer(kind_of(impl), n, np.arange(1, n + 1) if fill and rank == ROOT else None)
    if impl.startswith("mpi4py"):
        return Case(lambda: world.mpi.Bcast(x, ROOT), lambda: x, x)
    if impl == "gloo":
        import torch.distributed as dist

        return Case(lambda: dist.broadcast(x, src=ROOT), lambda: x, x)
    comm = spmd_of(world, impl)
    return Case(lambda: comm.broadcast(x, ROOT), lambda: x, x)


def reduction(world, impl, layout, fill, rooted):
    n, rank = layout.elems, world.rank
    x = buffer(kind_of(impl), n, np.full(n, rank + 1) if fill else None)
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
    comm = spmd_of(world, impl)
    if rooted:
        return Case(lambda: comm.reduce(x, ROOT), mine, x)
    return Case(lambda: comm.all_reduce(x), mine, x)


def scatter(world, impl, layout, fill, even):
    lengths, rank = list(layout.lengths), world.rank
    total, kind = sum(lengths), kind_of(impl)
    whole = None
    if rank == ROOT:
        whole = buffer(kind, total, np.arange(1, total + 1) if fill else None)
    box = [None]
    if impl.startswith("mpi4py"):
        from mpi4py import MPI

        out = buffer(kind, lengths[rank])
        c = world.mpi
        if even:
            op = lambda: c.Scatter(whole, out, ROOT)  # noqa: E731
        else:
            send = None
            if rank == ROOT:
                send = [whole, lengths, offsets(lengths), MPI.FLOAT]
            op = lambda: c.Scatterv(send, out, ROOT)  # noqa: E731
        return Case(op, lambda: out)
    if impl == "gloo":
        import torch.distributed as dist

        out = buffer(kind, lengths[rank])
        parts = list(whole.split(lengths)) if rank == ROOT else None
        return Case(lambda: dist.scatter(out, parts, src=ROOT), lambda: out)
    comm = spmd_of(world, impl)
    if impl.endswith("+equal"):
        out = buffer(kind, lengths[rank])
        return Case(lambda: comm.scatter(whole, ROOT, equal=True, out=out), lambda: out)
    # Even: the whole tensor, split by spmd; uneven: the list of chunks.
    chunks = whole if even or rank != ROOT else list(whole.split(lengths))

    def op():
        box[0] = comm.scatter(chunks, ROOT)

    return Case(op, lambda: box[0])


def gather(world, impl, layout, fill, everyone, even):
    lengths, rank = list(layout.lengths), world.rank
    total, kind = sum(lengths), kind_of(impl)
    x = buffer(kind, lengths[rank], np.full(lengths[rank], rank + 1) if fill else None)
    receives = everyone or rank == ROOT
    box = [None]
    if impl.startswith("mpi4py"):
        from mpi4py import MPI

        c = world.mpi
        recv = buffer(kind, total) if receives else None
        mine = lambda: recv  # noqa: E731
        if everyone:
            return Case(lambda: c.Allgather(x, recv), mine)
        if even:
            return Case(lambda: c.Gather(x, recv, ROOT), mine)
        spec = [recv, lengths, offsets(lengths), MPI.FLOAT] if receives else None
        return Case(lambda: c.Gatherv(x, spec, ROOT), mine)
    if impl == "gloo":
        import torch.distributed as dist

        recv = buffer(kind, total) if receives else None
        parts = list(recv.split(lengths)) if receives else None
        if everyone:
            return Case(lambda: dist.all_gather(parts, x), lambda: recv)
        return Case(lambda: dist.gather(x, parts, dst=ROOT), lambda: recv)
    comm = spmd_of(world, impl)
    if impl.endswith("+equal"):
        recv = buffer(kind, total) if receives else None
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


def many(world, impl, layout, fill):
    n, rank = layout.elems, world.rank
    base, coalesce = impl.split("+")[0], impl.endswith("+coalesce")
    xs = [buffer(kind_of(base), n, np.full(n, rank + 1) if fill else None) for _ in range(layout.count)]
    mine = lambda: xs  # noqa: E731
    if base.startswith("mpi4py"):  # also mpi4py-torchbuf
        from mpi4py import MPI

        c = world.mpi
        if not coalesce:
            return Case(lambda: [c.Allreduce(MPI.IN_PLACE, a, MPI.SUM) for a in xs], mine)
        return Case(lambda: coalesced(lambda f: c.Allreduce(MPI.IN_PLACE, f, MPI.SUM), xs), mine)
    if base == "gloo":
        import torch.distributed as dist

        if not coalesce:
            return Case(lambda: [dist.all_reduce(t) for t in xs], mine)
        return Case(lambda: coalesced(dist.all_reduce, xs), mine)
    comm = spmd_of(world, base)
    if not coalesce:
        return Case(lambda: [comm.all_reduce(t) for t in xs], mine)
    return Case(lambda: comm.all_reduce(xs), mine)  # spmd's list form: one call per dtype


def message(world, impl, layout, fill, pingpong):
    """pingpong: rank 0 sends, rank 1 sends it back (others idle); sendrecv: a ring, every rank at once."""
    n, rank, size = layout.elems, world.rank, world.size
    kind = kind_of(impl)
    if pingpong:
        x = buffer(kind, n, np.arange(1, n + 1) if fill and rank == 0 else None)
        if rank > 1:
            return Case(lambda: None, lambda: None)
        peer, first = 1 - rank, rank == 0
    else:
        x = buffer(kind, n, np.full(n, rank + 1) if fill else None)
        right, left = (rank + 1) % size, (rank - 1) % size
    y = buffer(kind, n)
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
    comm = spmd_of(world, impl)
    if not pingpong:
        return Case(lambda: comm.sendrecv(x, right, left, out=y), lambda: y)
    if first:
        return Case(lambda: (comm.send(x, peer), comm.recv(peer, out=y)), lambda: y)
    return Case(lambda: (comm.recv(peer, out=y), comm.send(y, peer)), lambda: y)


def all_to_all(world, impl, layout, fill):
    lengths, rank = list(layout.lengths), world.rank
    total, kind = sum(lengths), kind_of(impl)
    x = buffer(kind, total, np.full(total, rank + 1) if fill else None)
    y = buffer(kind, total)
    box = [None]
    if impl.startswith("mpi4py"):
        return Case(lambda: world.mpi.Alltoall(x, y), lambda: y)
    if impl == "gloo":
        import torch.distributed as dist

        return Case(lambda: dist.all_to_all_single(y, x), lambda: y)
    comm = spmd_of(world, impl)
    if impl.endswith("+equal"):
        return Case(lambda: comm.all_to_all(x, equal=True, out=y), lambda: y)

    def op():
        box[0] = comm.all_to_all(x)

    return Case(op, lambda: box[0])


def reduce_scatter(world, impl, layout, fill):
    lengths, rank = list(layout.lengths), world.rank
    total, kind = sum(lengths), kind_of(impl)
    x = buffer(kind, total, np.full(total, rank + 1) if fill else None)
    box = [None]
    if impl.startswith("mpi4py"):
        from mpi4py import MPI

        y = buffer(kind, lengths[rank])
        return Case(lambda: world.mpi.Reduce_scatter_block(x, y, MPI.SUM), lambda: y)
    if impl == "gloo":
        from spmd.comms.backends.torchdist.arrays import reduce_scatter_single

        y = buffer(kind, lengths[rank])
        return Case(lambda: reduce_scatter_single(y, x), lambda: y)
    comm = spmd_of(world, impl)

    def op():
        box[0] = comm.reduce_scatter(x)

    return Case(op, lambda: box[0])

# -- many small tensors ---------------------------------------------------------------


def coalesced(reduce_flat, xs):
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
