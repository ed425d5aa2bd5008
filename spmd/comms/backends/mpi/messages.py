"""Point to point, all_to_all, reduce_scatter and scans over mpi4py.

A mixin of :class:`~spmd.comms.backends.mpi.comm.MpiComm`: the hooks of the contract's
later families.  Bytes on the wire (MPI.BYTE) for data movement, typed
buffers for the reductions, as in the rest of the mpi backend.
"""

import numpy as np
from mpi4py import MPI

from spmd.comms.arrays import contiguous as _contiguous
from spmd.comms.handle import Handle
from spmd.comms.p2p.incoming import INLINE_BYTES
from spmd.comms.backends.mpi.buffers import displs as _displs
from spmd.comms.backends.mpi.buffers import kept as _kept
from spmd.comms.backends.mpi.buffers import raw as _raw
from spmd.comms.backends.mpi.buffers import row_bytes as _row_bytes

__all__ = ["MpiMessages"]


class MpiMessages:
    """_all_to_all, _reduce_scatter, _scan, _send and _recv on an mpi4py communicator (self._c)."""

    #: An MPI receive takes a message shorter than its buffer, so point-to-point data up to this
    #: size travels inside its header's message (spmd.comms.p2p.methods): one message instead of two.
    _inline_bytes = INLINE_BYTES

    def _bytes_of(self, c):
        return np.frombuffer(_raw(c), np.uint8)

    # -- all_to_all, reduce_scatter, scans -----------------------------------------

    def _all_to_all(self, parts, whole, sent, layout, out, async_op):
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

    def _reduce_scatter(self, x, lengths, op, async_op):
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

    def _scan(self, x, exclusive, op, async_op):
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

    def _send(self, x, dst, tag, async_op):
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

    def _recv(self, x, src, tag, async_op):
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
