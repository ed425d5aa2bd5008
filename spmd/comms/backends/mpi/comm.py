"""Collectives over mpi4py: zero-copy on CPU tensors and numpy arrays.

Data movement (broadcast, scatter, gathers) works on byte views, so
every dtype travels, bfloat16 included.  Reductions use MPI's typed
operations; bool uses the logical ones and bfloat16 is reduced in
float32.  Large reduces run as allreduces, which MPICH does faster.
The families live in mixins: :mod:`~spmd.comms.backends.mpi.reductions`,
:mod:`~spmd.comms.backends.mpi.gathers`, :mod:`~spmd.comms.backends.mpi.messages`.
"""

import numpy as np
from mpi4py import MPI

from spmd.comms.base import Comm
from spmd.comms.handle import Handle
from spmd.comms.backends.mpi.buffers import packer as _packer
from spmd.comms.backends.mpi.gathers import MpiGathers
from spmd.comms.backends.mpi.messages import MpiMessages
from spmd.comms.backends.mpi.reductions import MpiReductions

__all__ = ["MpiComm"]


def _new(kind, dtype, shape):
    if kind == "numpy":
        return np.empty(shape, dtype=dtype)
    import torch

    return torch.empty(shape, dtype=getattr(torch, dtype))


class MpiComm(MpiReductions, MpiGathers, MpiMessages, Comm):
    """A communicator backed by an mpi4py communicator."""

    backend = "mpi"

    def __init__(self, mpi_comm, placement=None, timeout=None, monitor=None, caches=None):
        self._c = mpi_comm
        self._rows = None  # where description rows are gathered
        size = mpi_comm.Get_size()
        self._max_tag = mpi_comm.Get_attr(MPI.TAG_UB) or 32767  # the standard's least
        super().__init__(mpi_comm.Get_rank(), size, placement, "cpu", timeout, monitor, caches)

    @staticmethod
    def _go(async_op, blocking, nonblocking, finish):
        if async_op:
            req = nonblocking()
            return Handle(req.Wait, req.Test, finish)
        blocking()
        return finish()

    def _empty(self, kind, dtype, shape):
        """Return a result array: a dropped one of this kind, dtype and shape, or a new one."""
        return self._caches.results.empty((kind, dtype, shape), shape, _new, kind, dtype, shape)

    def _mover(self, arrays):
        """Return a packer of these arrays into a flat buffer and back, or None (see coalesce)."""
        return _packer(arrays, self._caches.layouts)

    def _barrier(self):
        self._c.Barrier()

    def _allgather_ints(self, row):
        out = self._rows  # read by the caller before the next call
        if out is None or out.shape[1] != row.shape[0]:
            out = self._rows = np.empty((self.size, row.shape[0]), dtype=np.int64)
        self._c.Allgather(row, out)
        return out

    def _broadcast_ints(self, ints, root):
        self._c.Bcast(ints, root)
        return ints

    # -- objects -------------------------------------------------------------

    def _broadcast_object(self, obj, root):
        return self._c.bcast(obj, root)

    def _gather_object(self, obj, root):
        return self._c.gather(obj, root)

    def _all_gather_object(self, obj):
        return self._c.allgather(obj)

    def _scatter_object(self, objs, root):
        return self._c.scatter(objs, root)

    # -- sub-communicators -----------------------------------------------------

    def _split_comm(self, color, key):
        new = self._c.Split(MPI.UNDEFINED if color is None else color, key)
        if new == MPI.COMM_NULL:
            return None
        return MpiComm(new, self.placement, self.timeout, self._mon.child(), self._caches.child(new.Get_size()))

    def _free(self):
        self._c.Free()
        self._mon.forget()
        self._caches.clear()
