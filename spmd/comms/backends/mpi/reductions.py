"""Broadcast and the reductions over mpi4py: their direct hooks and general paths.

A mixin of :class:`~spmd.comms.backends.mpi.comm.MpiComm`.  Reductions use
MPI's typed operations; bool uses the logical ones and bfloat16 is reduced
in float32.  Large reduces run as allreduces, which MPICH does faster, and
large allreduces in pieces (docs/performance.md).
"""

from functools import partial

import numpy as np
from mpi4py import MPI

from spmd.comms.arrays import contiguous as _contiguous
from spmd.comms.backends.mpi.buffers import as_bytes as _bytes
from spmd.comms.backends.mpi.buffers import direct as _direct
from spmd.comms.backends.mpi.buffers import finish as _finish
from spmd.comms.backends.mpi.buffers import raw as _raw
from spmd.comms.backends.mpi.buffers import typed as _typed

__all__ = ["MpiReductions", "REDUCE_BY_ALLREDUCE", "PIECE"]

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


class MpiReductions:
    """_broadcast, _reduce, _all_reduce and their direct hooks on an mpi4py communicator (self._c)."""

    # -- direct hooks (fast paths) ----------------------------------------------
    # A blocking broadcast, reduce or all_reduce of one contiguous CPU array of
    # a plain numeric dtype, with debug and trace off, goes to MPI by address:
    # no views, copies or closures.  So do scatter and the gathers called with
    # equal=True and out= (shapes known, nothing to allocate).  Everything else
    # takes the general hooks below.

    def _direct_broadcast(self, x, root):
        buf = _direct(x)
        if buf is None:
            return None
        # As bytes, like the general path: the type signatures of all ranks
        # must match, whichever path each rank takes.
        return self._c.Bcast, (_bytes(buf), root)

    def _direct_all_reduce(self, x, op):
        mop = _FAST_OPS.get(op) if type(op) is str else None
        buf = None if mop is None else _direct(x)
        if buf is None or x.nbytes >= 2 * PIECE:  # larger: in pieces, on the general path
            return None
        return self._c.Allreduce, (MPI.IN_PLACE, buf, mop)

    def _direct_reduce(self, x, root, op):
        mop = _FAST_OPS.get(op) if type(op) is str else None
        buf = None if mop is None else _direct(x)
        if buf is None or x.nbytes >= REDUCE_BY_ALLREDUCE:
            return None
        if self.rank == root:
            return self._c.Reduce, (MPI.IN_PLACE, buf, mop, root)
        return self._c.Reduce, (buf, None, mop, root)

    # -- reductions and broadcast (general path) ---------------------------------

    def _broadcast(self, x, root, async_op):
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

    def _all_reduce(self, x, op, async_op):
        c, back = _contiguous(x)
        a, widened, mop = self._reduction(c, op)
        return self._go(
            async_op,
            lambda: self._allreduce_pieces(MPI.IN_PLACE, a, mop),
            lambda: self._c.Iallreduce(MPI.IN_PLACE, a, mop),
            lambda: self._finish_reduce(x, a, op, widened, back),
        )

    def _reduce(self, x, root, op, async_op):
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
