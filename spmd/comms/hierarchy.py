"""All_reduce by host: within each host first, across hosts once per host, then back within the host.

:class:`Hosts` says which ranks share a host (pure); :func:`wanted` and :func:`takes` decide when
(pure); :class:`Hierarchy` is one world's host grouping, built once, lazily, by every rank together
inside the first all_reduce that takes it, and its three steps: the sub-backends' hooks, run in one
thread of their own, as part of the one all_reduce call the world numbered.  Why, when and what it
saves: docs/comms.md and docs/performance.md, "Hierarchy across hosts".
"""

from __future__ import annotations

import socket
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from spmd.errors import CollectiveError
from spmd.comms.handle import Handle
from spmd.comms.stages import Stages

if TYPE_CHECKING:
    from spmd.comms.contract import Backend
    from spmd.config.placement import Placement

__all__ = ["Hosts", "Hierarchy", "wanted", "takes", "host_key", "MIN_BYTES", "BY_DEFAULT", "CAN"]

#: Arrays smaller than this stay flat: three steps cost more than the bytes they save
#: (docs/performance.md, "Hierarchy across hosts").
MIN_BYTES = 1 << 20

#: Backends that can take the hierarchy (SPMD_HIERARCHY=on); nccl has its own topology.
CAN = frozenset(("gloo", "mpi"))
#: Those that take it with SPMD_HIERARCHY=auto, by measurement (docs/performance.md).
BY_DEFAULT = frozenset(("gloo",))

#: The ops whose order of combination may change: exact for integers, within rounding for floats.
_OPS = frozenset(("sum", "prod", "min", "max", "avg"))


@dataclass(frozen=True)
class Hosts:
    """Which ranks of a communicator share a host: each host's ranks in rank order, hosts in order of their first rank."""

    groups: tuple[tuple[int, ...], ...]

    @classmethod
    def of(cls, keys: Sequence[Any]) -> Hosts:
        """Group ranks by their host's key (keys[r] is rank r's)."""
        order: dict[Any, list[int]] = {}
        for rank, key in enumerate(keys):
            order.setdefault(key, []).append(rank)
        return cls(tuple(tuple(ranks) for ranks in order.values()))

    def host(self, rank: int) -> int:
        """The number of rank's host."""
        for number, ranks in enumerate(self.groups):
            if rank in ranks:
                return number
        raise CollectiveError(f"rank {rank} is on none of the hosts {self.groups}")

    def leader(self, rank: int) -> int:
        """The rank that speaks for rank's host across hosts: its host's first."""
        return self.groups[self.host(rank)][0]

    @property
    def worth(self) -> bool:
        """Whether grouping pays: two hosts or more, and one of them holds two ranks or more."""
        return len(self.groups) >= 2 and any(len(ranks) >= 2 for ranks in self.groups)


def wanted(mode: str, backend: str, size: int, world: bool, num_nodes: int | None) -> bool:
    """Whether a communicator should look for its hosts at its first large all_reduce.

    mode is SPMD_HIERARCHY's; only a world of 3 ranks or more (a world's
    splits are made by every rank, which torch.distributed requires), on a
    backend that can, and under auto one that gains, on more than one node
    where the placement knows (num_nodes None: unknown).
    """
    if mode == "off" or not world or size < 3 or backend not in CAN:
        return False
    if mode == "on":
        return True
    return backend in BY_DEFAULT and num_nodes != 1


def takes(x: Any) -> bool:
    """Whether x goes by host: a contiguous CPU array of a real numeric dtype of at least MIN_BYTES."""
    if type(x) is np.ndarray:
        return x.nbytes >= MIN_BYTES and x.dtype.kind in "fiu" and x.flags.c_contiguous
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(x, torch.Tensor):
        return False
    return (x.numel() * x.element_size() >= MIN_BYTES and x.is_cpu and x.is_contiguous()
            and not x.dtype.is_complex and x.dtype != torch.bool)


def host_key(placement: Placement | None) -> str:
    """What names this rank's host: the node number spmd measured at init (from every rank's host card:
    name, boot and IPC namespace), else the host's name."""
    if placement is not None and placement.sources.get("node_rank", "").startswith("measured"):
        return f"node {placement.node_rank}"
    return f"name {socket.gethostname()}"


def _reduce(b: Backend, x, op) -> None:
    go = b.direct_reduce(x, 0, op)
    if go is not None:
        go[0](*go[1])
    else:
        b.reduce(x, 0, op, False)


def _all_reduce(b: Backend, x, op) -> None:
    go = b.direct_all_reduce(x, op)
    if go is not None:
        go[0](*go[1])
    else:
        b.all_reduce(x, op, False)


def _broadcast(b: Backend, x) -> None:
    go = b.direct_broadcast(x, 0)
    if go is not None:
        go[0](*go[1])
    else:
        b.broadcast(x, 0, False)


class Hierarchy:
    """One world's hosts (its host and leaders' backends) and the all_reduce over them.

    Built by :meth:`all_reduce` the first time, on every rank (the ranks
    agree: the array's size and dtype do); where grouping does not pay
    (:attr:`Hosts.worth`) it stays flat for good.  ``close()`` ends its
    thread; its backends end with the world's.
    """

    def __init__(self, backend: Backend, placement: Placement | None) -> None:
        self._world = backend
        self._placement = placement
        self.hosts: Hosts | None = None  # known once built
        self.flat = False  # built, and grouping does not pay
        self._host: Backend | None = None  # the ranks of this host
        self._leaders: Backend | None = None  # one rank per host; None on the others
        self._stages: Stages | None = None

    def _build(self) -> None:
        world = self._world
        hosts = Hosts.of(world.all_gather_object(host_key(self._placement)))
        self.hosts = hosts
        if not hosts.worth:
            self.flat = True
            return
        rank = world.rank
        self._host = world.split(hosts.host(rank), rank)
        self._leaders = world.split(0 if hosts.leader(rank) == rank else None, rank)
        self._stages = Stages("spmd-hierarchy")

    def all_reduce(self, x, op: str, async_op: bool):
        """Reduce x in place over the world by host (the hook its Comm's all_reduce runs); return x or a Handle."""
        if self.hosts is None:
            self._build()
        if self.flat:
            return self._world.all_reduce(x, op, async_op)
        job = self._stages.submit(lambda: self._run(x, op))  # type: ignore[union-attr]
        if async_op:
            return Handle(job.wait, job.test, lambda: x)
        job.wait()
        return x

    def _run(self, x, op: str) -> None:
        """Within the host to its leader, across hosts among leaders, back within the host."""
        t = x if type(x) is np.ndarray else x.detach()
        step = "sum" if op == "avg" else op
        host, leaders = self._host, self._leaders
        if host.size > 1:  # type: ignore[union-attr]
            _reduce(host, t, step)
        if leaders is not None:
            _all_reduce(leaders, t, step)
        if host.size > 1:  # type: ignore[union-attr]
            _broadcast(host, t)
        if op == "avg":
            if type(t) is np.ndarray:
                np.divide(t, self._world.size, out=t)
            else:
                t.div_(self._world.size)

    def close(self) -> None:
        """End the stages' thread (at finalize)."""
        stages, self._stages = self._stages, None
        if stages is not None:
            stages.stop()
