"""The communicator: :class:`Comm`, the one front of every backend.

Comm holds a backend (:class:`~spmd.comms.contract.Backend`: serial, mpi,
gloo, nccl, torch's general path), and everything else of a call: the public
methods (by family, from :mod:`spmd.comms.api.collectives`,
:mod:`spmd.comms.api.exchanges` and :mod:`spmd.comms.p2p.methods`), the
argument checks, the call path every call runs through, the monitor that
numbers calls for reports, and the error policy (:mod:`spmd.comms.policy`).
A backend only moves data, through the contract's hooks, after Comm's checks.
The reference, and how to write a backend: docs/comms.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from spmd.errors import CollectiveError, SpmdError
from spmd.failfast.calls import SEQ, Monitor
from spmd.comms.api.collectives import Collectives
from spmd.comms.api.exchanges import Exchanges
from spmd.comms.arrays import check_array, dtype_name
from spmd.comms.contract import Backend
from spmd.comms.handle import Done, Handle
from spmd.comms.hierarchy import Hierarchy, wanted
from spmd.comms.pipelined import Pipelined
from spmd.comms.pipelined import wanted as pipelined_wanted
from spmd.comms.p2p.incoming import receive_buffers
from spmd.comms.p2p.methods import PointToPoint
from spmd.comms.policy import CONVERTED, converted
from spmd.comms.state import meta
from spmd.comms.state.meta import Layout

if TYPE_CHECKING:
    from spmd.config.placement import Placement

__all__ = ["Comm", "Handle", "Done", "Layout", "Backend"]


class Comm(Collectives, Exchanges, PointToPoint):
    """A group of ranks and the collectives among them, over the backend it holds.

    The public methods come by family: :mod:`~spmd.comms.api.collectives`
    (the guide's collectives, barrier, objects), :mod:`~spmd.comms.api.exchanges`
    (all_to_all, reduce_scatter, scan), :mod:`~spmd.comms.p2p.methods` (point
    to point).  This class holds the rest: the backend, the call path, the
    checks, split and free.
    """

    #: Name of the backend: "serial", "gloo", "nccl" or "mpi".
    backend: str
    #: This process's rank in the communicator, and how many ranks it has.
    rank: int
    size: int
    #: Where the backend's arrays live: "cpu", or a CUDA device for nccl.
    device: str
    #: Seconds init and each collective may wait; None when unbounded.
    timeout: float | None
    #: The launcher's description of this process's place (None: a world of one without one).
    placement: Placement | None
    #: This process's rank and the number of ranks on its node; its node's rank, the number of nodes.
    local_rank: int
    local_size: int
    node_rank: int
    num_nodes: int
    #: The launcher that started the world ("mpirun", "torchrun", "slurm", ..., "none").
    launcher: str

    def __init__(self, backend: Backend, placement: Placement | None = None, monitor: Monitor | None = None,
                 hierarchy: str | None = None, pipelined: str | None = None) -> None:
        #: The transport: every hook a call ends in (spmd.comms.contract).
        self._backend = backend
        self._mon = monitor if monitor is not None else Monitor()
        #: Every piece of performance state kept for these ranks (spmd.comms.state.caches): the backend's.
        self._caches = backend.caches
        self.backend = backend.name
        self.rank = backend.rank
        self.size = backend.size
        self.device = backend.device
        self.timeout = backend.timeout
        self.placement = placement
        p = placement
        self.local_rank = p.local_rank if p else 0
        self.local_size = p.local_size if p else 1
        self.node_rank = p.node_rank if p else 0
        self.num_nodes = p.num_nodes if p else 1
        self.launcher = p.launcher if p else "none"
        self._descs = self._caches.descs  # array descriptions, kept per shape
        # Where non-root ranks receive scatter's header (read before the next call).
        self._header_buffer = np.zeros(1 + meta.WIDTH + self.size, dtype=np.int64)
        # Point to point (spmd.comms.p2p): pending immediate receives, and where a blocking
        # receive's header (and inline data) lands, one receive at a time.
        self._incoming: list[Any] = []
        self._recv_header, self._recv_row, self._recv_tail = receive_buffers(self)
        # Large all_reduces by host (spmd.comms.hierarchy) and large broadcasts down a chain, all_gathers
        # round a ring (spmd.comms.pipelined): SPMD_HIERARCHY's and SPMD_PIPELINED's values (None: read them
        # here; init passes its settings); a split keeps its world's pipelined and stays flat.
        if hierarchy is None or pipelined is None:
            import os

            from spmd.config.settings import parse_hierarchy, parse_pipelined

            hierarchy = parse_hierarchy(os.environ) if hierarchy is None else hierarchy
            pipelined = parse_pipelined(os.environ) if pipelined is None else pipelined
        go = wanted(hierarchy, self.backend, self.size, self._mon.world, p.num_nodes if p else None)
        self._hierarchy = Hierarchy(backend, placement) if go else None
        self._pipelined_mode = pipelined
        go = pipelined_wanted(pipelined, self.backend, self.size, p.num_nodes if p else None)
        self._pipelined = Pipelined(backend) if go else None

    def __repr__(self) -> str:
        return f"<Comm rank {self.rank} of {self.size}, backend {self.backend}>"

    # -- the call path: the one place every call runs through (docs/comms.md) --------

    def _call(self, hook, args, name, x=None, root=None, op=None, async_op=False, collective=True):
        """Run hook(*args) as this communicator's next call; return its result.

        The one bookkeeping path of every call, direct or general,
        collective or point to point: the sequence number and record
        (a :class:`~spmd.failfast.calls.Call` kept as a plain tuple, for
        timeout reports), debug mode's cross-rank check (collectives only)
        and the trace when on, and a backend's errors turned into spmd's
        (:func:`~spmd.comms.policy.converted`; an SpmdError raised inside
        goes on as it is).  The Handle of an async call is bound to the
        call: its wait() is bounded and converted the same way
        (:meth:`_waiting`).  For point to point, root is the peer and op the tag.
        """
        mon = self._mon
        call = mon.note(name, x, root, op)
        mon.busy = mon.seq  # the number note() just gave the call
        if not collective:
            mon.dirty = True
        try:
            if mon.active:
                result = mon.run(call, hook, args, x, async_op, collective, self._backend.all_gather_object)
            else:
                result = hook(*args)
        except SpmdError:
            raise
        except CONVERTED as exc:
            raise converted(self._backend, mon, exc, call) from exc
        finally:
            mon.busy = 0
        if async_op:
            result.bind(self, call)
        return result

    def _describing(self, name, x, root, fn, *args):
        """Run fn(*args), the description exchange that opens collective name, as part of it.

        The exchange is the first wait of the call, so a rank whose peers
        never come waits here: the timeout (the mpi watcher, or the torch
        backend's own) must see it, and report it under the call's number.
        """
        mon = self._mon
        call = mon.upcoming(name, x, root)
        mon.busy = call.seq
        try:
            return fn(*args)
        except SpmdError:
            raise
        except CONVERTED as exc:
            raise converted(self._backend, mon, exc, call) from exc
        finally:
            mon.busy, mon.pending = 0, None

    def _waiting(self, fn, call, block=True):
        """Run fn(), the wait (block) or test of the async call's handle, as part of that call.

        A wait is what the mpi watcher counts (busy is the call's number,
        and waiting its record, so the report names the call and says it was
        in wait()); either way a backend's error is converted as in the
        call itself.
        """
        mon = self._mon
        if block:
            before = mon.busy, mon.waiting
            mon.waiting, mon.busy = call, call[SEQ]
        try:
            return fn()
        except SpmdError:
            raise
        except CONVERTED as exc:
            raise converted(self._backend, mon, exc, call, waiting=True) from exc
        finally:
            if block:
                mon.busy, mon.waiting = before

    # -- the checks the public methods share (docs/comms.md, "Checks") ----------------

    def _root(self, root):
        """Return root when it is a rank of this communicator, else raise."""
        if type(root) is int and 0 <= root < self.size:
            return root
        if not isinstance(root, int) or isinstance(root, bool) or not 0 <= root < self.size:
            raise CollectiveError(
                f"root {root!r} is out of range: this communicator has ranks 0 to {self.size - 1}"
            )
        return int(root)

    def _array(self, x, what="x"):
        """Return x when it is an array this backend can send, else raise."""
        check_array(x, what)
        self._backend.check_device(x, what)
        return x

    @staticmethod
    def _kind_dtype(x):
        return ("numpy" if isinstance(x, np.ndarray) else "torch"), dtype_name(x)

    def _check_out(self, out, kind, dtype, shape, what):
        """Raise unless out can receive an array of this kind, dtype and shape."""
        got_kind, got_dtype = self._kind_dtype(out)
        contiguous = out.flags.c_contiguous if isinstance(out, np.ndarray) else out.is_contiguous()
        if (got_kind, got_dtype, tuple(out.shape)) != (kind, dtype, tuple(shape)) or not contiguous:
            raise CollectiveError(
                f"{what}: out must be a contiguous {kind} array of dtype {dtype} and shape "
                f"{tuple(shape)}, got a {'contiguous' if contiguous else 'non-contiguous'} "
                f"{got_kind} {got_dtype} array of shape {tuple(out.shape)}"
            )

    # -- sub-communicators -----------------------------------------------------

    def split(self, color: int | None = 0, key: int | None = None, *,
              ranks: Sequence[int] | None = None) -> Comm | None:
        """Split into sub-communicators, MPI_Comm_split style.

        Ranks passing the same color form one communicator, ordered by
        key then by rank; color None gets None back.  With ``ranks=[...]``
        the listed ranks (in that order) form one and the rest get None.
        Every rank must call split.
        """
        if ranks is not None:
            ranks = list(ranks)
            bad = [r for r in ranks if not isinstance(r, int) or not 0 <= r < self.size]
            if bad or len(set(ranks)) != len(ranks):
                raise CollectiveError(
                    f"split: ranks must be distinct integers in 0..{self.size - 1}, got {ranks}"
                )
            color = 0 if self.rank in ranks else None
            key = ranks.index(self.rank) if self.rank in ranks else 0
        if color is not None and (not isinstance(color, int) or color < 0):
            raise CollectiveError(f"split: color must be a non-negative int or None, got {color!r}")
        key = self.rank if key is None else key
        self._mon.dirty = True  # a group now hangs off this communicator
        backend = self._call(self._backend.split, (color, key), "split")
        return None if backend is None else Comm(backend, self.placement, self._mon.child(), "off",
                                                      self._pipelined_mode)

    def free(self) -> None:
        """Release a communicator that split made, as MPI_Comm_free: its ranks call it together.

        Its process group (or MPI communicator) and buffers go at once, not
        at finalize; it cannot be used after.  The world ends with
        spmd.finalize().
        """
        if self._mon.family[0] is self._mon:  # the world's monitor heads the family of its splits
            raise CollectiveError("free: the world communicator ends with spmd.finalize(), not free()")
        self._backend.free()
        self._mon.forget()
        self._caches.clear()

    def _close(self):
        """Release what the backend holds (the runtime's finalize)."""
        if self._hierarchy is not None:
            self._hierarchy.close()
        if self._pipelined is not None:
            self._pipelined.close()
        self._backend.close()
