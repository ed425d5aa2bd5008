"""The mpi backend: the contract's hooks over an mpi4py communicator, zero-copy on CPU tensors and numpy arrays.

Data movement (broadcast, scatter, the gathers, all_to_all, point to point)
works on byte views (MPI.BYTE), so every dtype travels, bfloat16 included.
Reductions use MPI's typed operations; bool uses the logical ones and
bfloat16 is reduced in float32.  Large reduces run as allreduces, which MPICH
does faster, and large allreduces in pieces (docs/performance.md).  Buffers,
datatypes and the coalesced all_reduce's packer: :mod:`spmd.comms.backends.mpi.buffers`.
"""

from functools import partial

import numpy as np
from mpi4py import MPI

from spmd.comms.arrays import contiguous as _contiguous
from spmd.comms.arrays import split_rows
from spmd.comms.contract import Backend
from spmd.comms.handle import Handle
from spmd.comms.p2p.incoming import INLINE_BYTES
from spmd.comms.state import plans
from spmd.comms.state.caches import Caches
from spmd.comms.backends.mpi.buffers import address as _address
from spmd.comms.backends.mpi.buffers import as_bytes as _bytes
from spmd.comms.backends.mpi.buffers import contig as _contig
from spmd.comms.backends.mpi.buffers import direct as _direct
from spmd.comms.backends.mpi.buffers import displs as _displs
from spmd.comms.backends.mpi.buffers import finish as _finish
from spmd.comms.backends.mpi.buffers import kept as _kept
from spmd.comms.backends.mpi.buffers import packer as _packer
from spmd.comms.backends.mpi.buffers import raw as _raw
from spmd.comms.backends.mpi.buffers import row_bytes as _row_bytes
from spmd.comms.backends.mpi.buffers import typed as _typed

__all__ = ["MpiBackend", "REDUCE_BY_ALLREDUCE", "PIECE"]

#: From this many bytes on, reduce runs as an allreduce (into scratch space on
#: the other ranks): MPICH's reduce is several times slower there (docs/performance.md).
REDUCE_BY_ALLREDUCE = 256 * 1024
#: Blocking allreduces of at least twice this many bytes run in pieces of this
#: size: MPICH's allreduce of 64-256 MiB is 2-3x slower than the same bytes in
#: 16 MiB pieces here (docs/performance.md), and the scratch space MPI takes
#: (half the message) stays one piece.
PIECE = 16 << 20

_FAST_OPS = {"sum": MPI.SUM, "prod": MPI.PROD, "min": MPI.MIN, "max": MPI.MAX}  # no "avg"
_OPS = dict(_FAST_OPS, avg=MPI.SUM)
_BOOL_OPS = {"sum": MPI.LOR, "prod": MPI.LAND, "min": MPI.LAND, "max": MPI.LOR}


def _returning(result, fn, *args):
    """Run fn(*args), an MPI call that works on result's memory, and return result."""
    fn(*args)
    return result


def _new_like(c, shape):
    return np.empty(shape, c.dtype) if type(c) is np.ndarray else c.new_empty(shape)


def _new(kind, dtype, shape):
    if kind == "numpy":
        return np.empty(shape, dtype=dtype)
    import torch

    return torch.empty(shape, dtype=getattr(torch, dtype))


class MpiBackend(Backend):
    """The hooks over an mpi4py communicator (``self._c``).

    Long because its one job is: every hook of the contract, each with its
    blocking and nonblocking MPI call, and the direct hooks of the fast path.
    """

    name = "mpi"
    #: An MPI receive takes a message shorter than its buffer, so point-to-point data up to this
    #: size travels inside its header's message (spmd.comms.p2p.methods): one message instead of two.
    inline_bytes = INLINE_BYTES

    def __init__(self, mpi_comm, timeout=None, caches=None):
        self._c = mpi_comm
        self._rows = None  # where description rows are gathered
        self.rank, self.size = mpi_comm.Get_rank(), mpi_comm.Get_size()
        self.timeout = timeout
        self.max_tag = mpi_comm.Get_attr(MPI.TAG_UB) or 32767  # the standard's least
        self.caches = caches if caches is not None else Caches(self.size)

    @staticmethod
    def _go(async_op, blocking, nonblocking, finish):
        if async_op:
            req = nonblocking()
            return Handle(req.Wait, req.Test, finish)
        blocking()
        return finish()

    def _empty(self, kind, dtype, shape):
        """Return a result array: a dropped one of this kind, dtype and shape, or a new one."""
        return self.caches.results.empty((kind, dtype, shape), shape, _new, kind, dtype, shape)

    def mover(self, arrays):
        """Return a packer of these arrays into a flat buffer and back, or None (see coalesce)."""
        return _packer(arrays, self.caches.layouts)

    def barrier(self):
        self._c.Barrier()

    def allgather_ints(self, row):
        out = self._rows  # read by the caller before the next call
        if out is None or out.shape[1] != row.shape[0]:
            out = self._rows = np.empty((self.size, row.shape[0]), dtype=np.int64)
        self._c.Allgather(row, out)
        return out

    def broadcast_ints(self, ints, root):
        self._c.Bcast(ints, root)
        return ints

    # -- objects -------------------------------------------------------------

    def broadcast_object(self, obj, root):
        return self._c.bcast(obj, root)

    def gather_object(self, obj, root):
        return self._c.gather(obj, root)

    def all_gather_object(self, obj):
        return self._c.allgather(obj)

    def scatter_object(self, objs, root):
        return self._c.scatter(objs, root)

    # -- sub-communicators -----------------------------------------------------

    def split(self, color, key):
        new = self._c.Split(MPI.UNDEFINED if color is None else color, key)
        if new == MPI.COMM_NULL:
            return None
        return MpiBackend(new, self.timeout, self.caches.child(new.Get_size()))

    def free(self):
        self._c.Free()

    # -- direct hooks (fast paths) ----------------------------------------------
    # A blocking broadcast, reduce or all_reduce of one contiguous CPU array of
    # a plain numeric dtype, with debug and trace off, goes to MPI by address:
    # no views, copies or closures.  So do scatter and the gathers called with
    # equal=True and out= (shapes known, nothing to allocate).  Everything else
    # takes the general hooks below.

    def direct_broadcast(self, x, root):
        buf = _direct(x)
        if buf is None:
            return None
        # As bytes, like the general path: the type signatures of all ranks
        # must match, whichever path each rank takes.
        return self._c.Bcast, (_bytes(buf), root)

    def direct_all_reduce(self, x, op):
        mop = _FAST_OPS.get(op) if type(op) is str else None
        buf = None if mop is None else _direct(x)
        if buf is None or x.nbytes >= 2 * PIECE:  # larger: in pieces, on the general path
            return None
        return self._c.Allreduce, (MPI.IN_PLACE, buf, mop)

    def direct_reduce(self, x, root, op):
        mop = _FAST_OPS.get(op) if type(op) is str else None
        buf = None if mop is None else _direct(x)
        if buf is None or x.nbytes >= REDUCE_BY_ALLREDUCE:
            return None
        if self.rank == root:
            return self._c.Reduce, (MPI.IN_PLACE, buf, mop, root)
        return self._c.Reduce, (buf, None, mop, root)

    # -- reductions and broadcast (general path) ---------------------------------

    def broadcast(self, x, root, async_op):
        c, back = _contiguous(x)
        b = [_raw(c), MPI.BYTE]
        return self._go(
            async_op,
            lambda: self._c.Bcast(b, root),
            lambda: self._c.Ibcast(b, root),
            lambda: _finish(x, back),
        )

    def _reduction(self, c, op):
        a, widened = _typed(c)
        mop = _BOOL_OPS[op] if a.dtype == np.bool_ else _OPS[op]
        return a, widened, mop

    def all_reduce(self, x, op, async_op):
        c, back = _contiguous(x)
        a, widened, mop = self._reduction(c, op)
        return self._go(
            async_op,
            lambda: self._allreduce_pieces(MPI.IN_PLACE, a, mop),
            lambda: self._c.Iallreduce(MPI.IN_PLACE, a, mop),
            lambda: self._finish_reduce(x, a, op, widened, back),
        )

    def reduce(self, x, root, op, async_op):
        c, back = _contiguous(x)
        a, widened, mop = self._reduction(c, op)
        if self.rank == root:
            send, recv = MPI.IN_PLACE, a
            finish = partial(self._finish_reduce, x, a, op, widened, back)
        else:  # this rank's x stays as it was
            send, recv, finish = a, None, lambda: x
        if a.nbytes >= REDUCE_BY_ALLREDUCE:  # other ranks get the result in scratch space
            if async_op:
                recv = recv if self.rank == root else np.empty_like(a)
                return self._go(True, None, lambda: self._c.Iallreduce(send, recv, mop), finish)
            self._allreduce_pieces(send, a if recv is None else recv, mop, scratch=recv is None)
            return finish()
        return self._go(
            async_op,
            lambda: self._c.Reduce(send, recv, mop, root),
            lambda: self._c.Ireduce(send, recv, mop, root),
            finish,
        )

    def _allreduce_pieces(self, send, a, mop, scratch=False):
        """Allreduce numpy array a, in pieces of PIECE bytes once it is twice that.

        send is MPI.IN_PLACE (a is reduced in place) or, with scratch, a
        itself: the result then lands in a buffer of one piece and is
        dropped (reduce on ranks other than root).
        """
        step = max(1, PIECE // max(1, a.itemsize))
        flat = a.reshape(-1)
        if a.nbytes < 2 * PIECE:
            pieces = [flat]
        else:
            pieces = [flat[i : i + step] for i in range(0, flat.shape[0], step)]
        sink = self._scratch_like(pieces[0]) if scratch else None
        for piece in pieces:
            if scratch:
                self._c.Allreduce(piece, sink[: piece.shape[0]], mop)
            else:
                self._c.Allreduce(MPI.IN_PLACE, piece, mop)

    def _scratch_like(self, a):
        """Return a buffer like a for results nobody reads (reduce on the ranks other than root).

        A fresh one per call: keeping one gained 1-2% at 4 MiB in a 2-rank
        run (docs/performance.md, "What the caches are worth"), so it went.
        """
        return np.empty_like(a)

    def _finish_reduce(self, x, a, op, widened, back):
        if op == "avg":
            np.divide(a, self.size, out=a)
        if widened is not None:
            widened()
        return _finish(x, back)

    # -- direct hooks (fast paths): scatter and the gathers called with equal=True
    # and out= (shapes known, nothing to allocate); see the reductions' above.

    def _same_layout(self, x, out, rows):
        """Tell whether out is x's dtype with rows rows of x's trailing shape."""
        return out.dtype == x.dtype and out.shape[0] == rows and out.shape[1:] == x.shape[1:]

    def direct_all_gather(self, x, out):
        planned = type(out) is not np.ndarray  # torch tensors: their addresses and views cost
        key = ("all_gather", None, id(x), id(out))
        if planned:
            go = plans.find(self.caches.plans, key, (x, out))
            if go is not None:
                return go
        send, recv = _direct(x), _direct(out)
        if send is None or recv is None or not self._same_layout(x, out, x.shape[0] * self.size):
            return None
        if planned:
            return self._planned(key, (x, out), out, self._c.Allgather, _bytes(send), _bytes(recv))
        return self._into_pieces, (out, self._c.Allgather, _bytes(send), _bytes(recv))

    def direct_gather(self, x, root, out):
        planned = type(x) is not np.ndarray
        key = ("gather", root, id(x), id(out))
        if planned:
            go = plans.find(self.caches.plans, key, (x,) if out is None else (x, out))
            if go is not None:
                return go
        send = _direct(x)
        if send is None:
            return None
        if self.rank != root:
            go = _returning, (None, self._c.Gather, _bytes(send), None, root)
            return plans.keep(self.caches.plans, key, (x,), go) if planned else go
        recv = None if out is None else _direct(out)
        if recv is None or not self._same_layout(x, out, x.shape[0] * self.size):
            return None
        if planned and type(out) is not np.ndarray:
            return self._planned(key, (x, out), out, self._c.Gather, _bytes(send), _bytes(recv), root)
        return self._into_pieces, (out, self._c.Gather, _bytes(send), _bytes(recv), root)

    def direct_scatter(self, chunks, root, out):
        planned = type(out) is not np.ndarray and (chunks is None or type(chunks) is type(out))
        key = ("scatter", root, id(chunks), id(out))
        tensors = (out,) if chunks is None else (chunks, out)
        if planned:
            go = plans.find(self.caches.plans, key, tensors)
            if go is not None:
                return go
        recv = _direct(out)
        if recv is None:
            return None
        send = None
        if self.rank == root:
            send = _direct(chunks)
            if send is None or not self._same_layout(out, chunks, out.shape[0] * self.size):
                return None
            send = _bytes(send)
        go = _returning, (out, self._c.Scatter, send, _bytes(recv), root)
        return plans.keep(self.caches.plans, key, tensors, go) if planned else go

    def _planned(self, key, tensors, full, fn, *args):
        """Return the direct call fn(*args) that fills full, handing out full's pieces, kept as a plan."""
        pieces = self._even_pieces(full)
        go = plans.handing_out, (pieces, fn, *args)
        return plans.keep(self.caches.plans, key, tensors, go, own=pieces)

    def _into_pieces(self, full, fn, *args):
        """Run fn(*args), which fills full, and return full cut into one view per rank."""
        fn(*args)
        return self._even_pieces(full)

    def _even_pieces(self, full):
        """Cut full along dim 0 into one view per rank, all the same length."""
        if type(full) is np.ndarray:  # slices: cheaper than a reshape into rows
            k = full.shape[0] // self.size
            return [full[i * k : (i + 1) * k] for i in range(self.size)]
        return list(full.chunk(self.size))
    # -- scatter and gathers -----------------------------------------------------
    # Bytes on the wire (MPI.BYTE), so every dtype travels.  When every rank
    # has the same length, the plain collective (Scatter, Gather, Allgather);
    # else its v-form with counts and displacements.

    def scatter(self, parts, whole, layout, root, out, async_op):
        lengths, trail = layout.lengths, layout.trail
        if out is None:
            out = self._empty(layout.kind, layout.dtype, (lengths[self.rank],) + trail)
        recv = [_raw(out), MPI.BYTE]
        even = lengths.count(lengths[0]) == self.size
        send = keep = None
        if self.rank == root:
            data, keep = self._joined(parts, whole)
            if even:
                send = [data, MPI.BYTE]
            else:
                row = _row_bytes(out, trail)
                counts = [n * row for n in lengths]
                send = [data, counts, _displs(counts), MPI.BYTE]
        if even:
            return self._go(
                async_op,
                lambda: self._c.Scatter(send, recv, root),
                lambda: self._c.Iscatter(send, recv, root),
                lambda: _kept(out, keep),  # root's chunks stay alive until done
            )
        return self._go(
            async_op,
            lambda: self._c.Scatterv(send, recv, root),
            lambda: self._c.Iscatterv(send, recv, root),
            lambda: _kept(out, keep),
        )

    @staticmethod
    def _joined(parts, whole):
        """Return root's chunks as one buffer, without a copy when they are one already.

        Also return what must stay alive until the call is done: a buffer
        read by address (a tensor's) does not hold the memory it reads.
        """
        if whole is not None:
            whole = _contig(whole)
            return _raw(whole), whole
        cs = [_contig(p) for p in parts]
        # Views of consecutive pieces of one buffer (a split array): send from its start.
        start = address = _address(cs[0])
        for c in cs:
            if _address(c) != address:
                break
            address += c.nbytes
        else:
            return (MPI.buffer.fromaddress(start, address - start) if address > start else _raw(cs[0])), cs
        return np.concatenate([np.frombuffer(_raw(c), np.uint8) for c in cs]), None

    def _gathered(self, x, lengths, out):
        """Prepare a gather of x: (send spec, x contiguous, full array, recv spec, even).

        The contiguous x must stay alive until the call is done: the send
        spec reads a tensor by address and does not hold its memory.
        """
        c = _contig(x)
        trail = tuple(c.shape[1:])
        shape = (sum(lengths),) + trail
        full = out
        if full is None:
            full = self.caches.results.empty((type(c), c.dtype, shape), shape, _new_like, c, shape)
        even = lengths.count(lengths[0]) == self.size
        if even:
            recv = [_raw(full), MPI.BYTE]
        else:
            row = _row_bytes(full, trail)
            counts = [n * row for n in lengths]
            recv = [_raw(full), counts, _displs(counts), MPI.BYTE]
        return [_raw(c), MPI.BYTE], c, full, recv, even

    def _pieces(self, full, lengths, even):
        """Cut the gathered array into one view per rank."""
        return self._even_pieces(full) if even and lengths[0] else split_rows(full, lengths)

    def gather(self, x, lengths, root, out, async_op):
        if self.rank == root:
            send, c, full, recv, even = self._gathered(x, lengths, out)
        else:
            c, full, recv, even = _contig(x), None, None, lengths.count(lengths[0]) == self.size
            send = [_raw(c), MPI.BYTE]

        def finish():  # c, the send buffer, stays alive until done
            return _kept(None if full is None else self._pieces(full, lengths, even), c)

        blocking = self._c.Gather if even else self._c.Gatherv
        nonblocking = self._c.Igather if even else self._c.Igatherv
        return self._go(async_op, lambda: blocking(send, recv, root), lambda: nonblocking(send, recv, root), finish)

    def all_gather(self, x, lengths, out, async_op):
        send, c, full, recv, even = self._gathered(x, lengths, out)
        blocking = self._c.Allgather if even else self._c.Allgatherv
        nonblocking = self._c.Iallgather if even else self._c.Iallgatherv
        return self._go(
            async_op,
            lambda: blocking(send, recv),
            lambda: nonblocking(send, recv),
            lambda: _kept(self._pieces(full, lengths, even), c),
        )

    def bytes_of(self, c):
        return np.frombuffer(_raw(c), np.uint8)

    # -- all_to_all, reduce_scatter, scans -----------------------------------------

    def all_to_all(self, parts, whole, sent, layout, out, async_op):
        received, trail = layout.lengths, layout.trail
        full = out if out is not None else self._empty(layout.kind, layout.dtype, (sum(received),) + trail)
        data, keep = self._joined(parts, whole)
        row = _row_bytes(full, trail)
        even = sent.count(sent[0]) == self.size and received.count(received[0]) == self.size
        if even:
            send, recv = [data, MPI.BYTE], [_raw(full), MPI.BYTE]
            blocking, nonblocking = self._c.Alltoall, self._c.Ialltoall
        else:
            scounts, rcounts = [n * row for n in sent], [n * row for n in received]
            send = [data, scounts, _displs(scounts), MPI.BYTE]
            recv = [_raw(full), rcounts, _displs(rcounts), MPI.BYTE]
            blocking, nonblocking = self._c.Alltoallv, self._c.Ialltoallv
        return self._go(
            async_op,
            lambda: blocking(send, recv),
            lambda: nonblocking(send, recv),
            lambda: _kept(self._pieces(full, received, even), keep),
        )

    def reduce_scatter(self, x, lengths, op, async_op):
        c, _ = _contiguous(x)
        a, widened, mop = self._reduction(c, op)
        per_row = a[:1].size if a.shape[0] else 0
        mine = np.empty((lengths[self.rank],) + a.shape[1:], a.dtype)
        counts = [n * per_row for n in lengths]

        def finish():
            if op == "avg":
                np.divide(mine, self.size, out=mine)
            if type(x) is np.ndarray:
                return mine
            import torch

            return torch.from_numpy(mine).to(x.dtype)  # bfloat16 was reduced in float32

        return self._go(
            async_op,
            lambda: self._c.Reduce_scatter(a, mine, counts, mop),
            lambda: self._c.Ireduce_scatter(a, mine, counts, mop),
            lambda: _kept(finish(), a),
        )

    def scan(self, x, exclusive, op, async_op):
        c, back = _contiguous(x)
        a, widened, mop = self._reduction(c, op)
        blocking = self._c.Exscan if exclusive else self._c.Scan
        nonblocking = self._c.Iexscan if exclusive else self._c.Iscan
        return self._go(
            async_op,
            lambda: blocking(MPI.IN_PLACE, a, mop),
            lambda: nonblocking(MPI.IN_PLACE, a, mop),
            lambda: self._finish_reduce(x, a, op, widened, back),
        )

    # -- point to point ------------------------------------------------------------

    def send(self, x, dst, tag, async_op):
        if dst == self.rank and not async_op:
            return self._send_self(x, tag)
        buf = [_raw(x), MPI.BYTE]
        if not async_op:
            self._c.Send(buf, dst, tag)
            return None
        req = self._c.Isend(buf, dst, tag)
        return Handle(req.Wait, req.Test, lambda: _kept(None, x))  # x stays alive until done

    def _send_self(self, x, tag):
        """A blocking send to this rank itself: MPI may wait for the receive, which comes later
        on this same thread; so send a copy, immediately, and keep it until MPI is done with it."""
        copy = np.frombuffer(_raw(x), np.uint8).copy() if type(x) is not np.ndarray else x.copy()
        pending = [(r, c) for r, c in self.__dict__.get("_self_sends", ()) if not r.Test()]
        pending.append((self._c.Isend([copy, MPI.BYTE], self.rank, tag), copy))
        self._self_sends = pending

    def recv(self, x, src, tag, async_op):
        buf = [_raw(x), MPI.BYTE]
        if not async_op:
            if src is None:
                status = MPI.Status()
                self._c.Recv(buf, MPI.ANY_SOURCE, tag, status)
                src = status.Get_source()
            else:
                self._c.Recv(buf, src, tag)
            if self.__dict__.get("_self_sends"):
                self._self_sends = [(r, c) for r, c in self._self_sends if not r.Test()]
            return src
        status = MPI.Status()
        source = MPI.ANY_SOURCE if src is None else src
        req = self._c.Irecv(buf, source, tag)
        done = []  # a Test that succeeded filled status and freed req: Wait must not run again

        def test():
            if req.Test(status):
                done.append(True)
            return bool(done)

        def wait():
            if not done:
                req.Wait(status)

        return Handle(wait, test, lambda: _kept(status.Get_source(), x))
