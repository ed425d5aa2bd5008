"""Scatter and the gathers over mpi4py: their direct hooks and general paths.

A mixin of :class:`~spmd.comms.backends.mpi.comm.MpiComm`.  Data movement
works on byte views (MPI.BYTE), so every dtype travels, bfloat16 included.
"""

import numpy as np
from mpi4py import MPI

from spmd.comms.state import plans
from spmd.comms.backends.mpi.buffers import address as _address
from spmd.comms.backends.mpi.buffers import as_bytes as _bytes
from spmd.comms.backends.mpi.buffers import contig as _contig
from spmd.comms.backends.mpi.buffers import direct as _direct
from spmd.comms.backends.mpi.buffers import displs as _displs
from spmd.comms.backends.mpi.buffers import kept as _kept
from spmd.comms.backends.mpi.buffers import raw as _raw
from spmd.comms.backends.mpi.buffers import row_bytes as _row_bytes

__all__ = ["MpiGathers"]


def _returning(result, fn, *args):
    """Run fn(*args), an MPI call that works on result's memory, and return result."""
    fn(*args)
    return result


def _new_like(c, shape):
    return np.empty(shape, c.dtype) if type(c) is np.ndarray else c.new_empty(shape)


class MpiGathers:
    """_scatter, _gather, _all_gather and their direct hooks on an mpi4py communicator (self._c)."""

    # -- direct hooks (fast paths): scatter and the gathers called with equal=True
    # and out= (shapes known, nothing to allocate); see MpiReductions.

    def _same_layout(self, x, out, rows):
        """Tell whether out is x's dtype with rows rows of x's trailing shape."""
        return out.dtype == x.dtype and out.shape[0] == rows and out.shape[1:] == x.shape[1:]

    def _direct_all_gather(self, x, out):
        planned = type(out) is not np.ndarray  # torch tensors: their addresses and views cost
        key = ("all_gather", None, id(x), id(out))
        if planned:
            go = plans.find(self._caches.plans, key, (x, out))
            if go is not None:
                return go
        send, recv = _direct(x), _direct(out)
        if send is None or recv is None or not self._same_layout(x, out, x.shape[0] * self.size):
            return None
        if planned:
            return self._planned(key, (x, out), out, self._c.Allgather, _bytes(send), _bytes(recv))
        return self._into_pieces, (out, self._c.Allgather, _bytes(send), _bytes(recv))

    def _direct_gather(self, x, root, out):
        planned = type(x) is not np.ndarray
        key = ("gather", root, id(x), id(out))
        if planned:
            go = plans.find(self._caches.plans, key, (x,) if out is None else (x, out))
            if go is not None:
                return go
        send = _direct(x)
        if send is None:
            return None
        if self.rank != root:
            go = _returning, (None, self._c.Gather, _bytes(send), None, root)
            return plans.keep(self._caches.plans, key, (x,), go) if planned else go
        recv = None if out is None else _direct(out)
        if recv is None or not self._same_layout(x, out, x.shape[0] * self.size):
            return None
        if planned and type(out) is not np.ndarray:
            return self._planned(key, (x, out), out, self._c.Gather, _bytes(send), _bytes(recv), root)
        return self._into_pieces, (out, self._c.Gather, _bytes(send), _bytes(recv), root)

    def _direct_scatter(self, chunks, root, out):
        planned = type(out) is not np.ndarray and (chunks is None or type(chunks) is type(out))
        key = ("scatter", root, id(chunks), id(out))
        tensors = (out,) if chunks is None else (chunks, out)
        if planned:
            go = plans.find(self._caches.plans, key, tensors)
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
        return plans.keep(self._caches.plans, key, tensors, go) if planned else go

    def _planned(self, key, tensors, full, fn, *args):
        """Return the direct call fn(*args) that fills full, handing out full's pieces, kept as a plan."""
        pieces = self._even_pieces(full)
        go = plans.handing_out, (pieces, fn, *args)
        return plans.keep(self._caches.plans, key, tensors, go, own=pieces)

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

    def _scatter(self, parts, whole, layout, root, out, async_op):
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
            full = self._caches.results.empty((type(c), c.dtype, shape), shape, _new_like, c, shape)
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
        return self._even_pieces(full) if even and lengths[0] else self._split(full, lengths)

    def _gather(self, x, lengths, root, out, async_op):
        even = lengths.count(lengths[0]) == self.size
        if self.rank != root:
            c = _contig(x)
            send = [_raw(c), MPI.BYTE]
            blocking = self._c.Gather if even else self._c.Gatherv
            nonblocking = self._c.Igather if even else self._c.Igatherv
            return self._go(
                async_op,
                lambda: blocking(send, None, root),
                lambda: nonblocking(send, None, root),
                lambda: _kept(None, c),  # the send buffer stays alive until done
            )
        send, c, full, recv, even = self._gathered(x, lengths, out)
        blocking = self._c.Gather if even else self._c.Gatherv
        nonblocking = self._c.Igather if even else self._c.Igatherv
        return self._go(
            async_op,
            lambda: blocking(send, recv, root),
            lambda: nonblocking(send, recv, root),
            lambda: _kept(self._pieces(full, lengths, even), c),
        )

    def _all_gather(self, x, lengths, out, async_op):
        send, c, full, recv, even = self._gathered(x, lengths, out)
        blocking = self._c.Allgather if even else self._c.Allgatherv
        nonblocking = self._c.Iallgather if even else self._c.Iallgatherv
        return self._go(
            async_op,
            lambda: blocking(send, recv),
            lambda: nonblocking(send, recv),
            lambda: _kept(self._pieces(full, lengths, even), c),
        )
