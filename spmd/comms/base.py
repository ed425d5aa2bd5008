"""The communicator: :class:`Comm`, what every backend subclasses.

Every public method lives in Comm (by family, from the mixins of
:mod:`spmd.comms.api` and :mod:`spmd.comms.p2p`), and only there; a backend
never overrides one.  The hooks a backend implements are in
:mod:`spmd.comms.contract`, the path every call runs through in
:mod:`spmd.comms.call`, the error policy in :mod:`spmd.comms.policy`.
The reference, and how to write a backend: docs/comms.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from spmd.failfast.calls import Monitor
from spmd.comms.state import meta
from spmd.comms.state.caches import Caches
from spmd.comms.api.collectives import Collectives
from spmd.comms.api.exchanges import Exchanges
from spmd.comms.api.objects import Objects
from spmd.comms.call import CallPath
from spmd.comms.checks import Checks
from spmd.comms.contract import Contract
from spmd.comms.handle import Done, Handle
from spmd.comms.p2p.incoming import receive_buffers
from spmd.comms.p2p.methods import PointToPoint
from spmd.comms.state.meta import Layout

if TYPE_CHECKING:
    from spmd.config.placement import Placement

__all__ = ["Comm", "Handle", "Done", "Layout"]


class Comm(Collectives, Exchanges, PointToPoint, Objects, CallPath, Checks, Contract):
    """A group of ranks and the collectives among them.

    The public methods come by family from the mixins: :mod:`~spmd.comms.api.collectives`,
    :mod:`~spmd.comms.api.exchanges` (all_to_all, reduce_scatter, scan),
    :mod:`~spmd.comms.p2p.methods` (point to point), :mod:`~spmd.comms.api.objects`.
    """

    #: Name of the backend: "serial", "gloo", "nccl" or "mpi".
    backend: str | None = None
    #: The largest tag the backend's point-to-point messages may carry.
    _max_tag = 2**31 - 1

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

    def __init__(
        self,
        rank: int,
        size: int,
        placement: Placement | None = None,
        device: str = "cpu",
        timeout: float | None = None,
        monitor: Monitor | None = None,
        caches: Caches | None = None,
    ) -> None:
        self._mon = monitor if monitor is not None else Monitor()
        #: Every piece of performance state this communicator keeps (spmd.comms.state.caches).
        self._caches = caches if caches is not None else Caches(size)
        self.rank = rank
        self.size = size
        self.device = device
        self.timeout = timeout
        self.placement = placement
        p = placement
        self.local_rank = p.local_rank if p else 0
        self.local_size = p.local_size if p else 1
        self.node_rank = p.node_rank if p else 0
        self.num_nodes = p.num_nodes if p else 1
        self.launcher = p.launcher if p else "none"
        self._descs = self._caches.descs  # array descriptions, kept per shape
        # Where non-root ranks receive scatter's header (read before the next call).
        self._header_buffer = np.zeros(1 + meta.WIDTH + size, dtype=np.int64)
        # Point to point (spmd.comms.p2p): pending immediate receives, and where a blocking
        # receive's header (and inline data) lands, one receive at a time.
        self._incoming: list[Any] = []
        self._recv_header, self._recv_row, self._recv_tail = receive_buffers(self)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} rank {self.rank} of {self.size}, backend {self.backend}>"
