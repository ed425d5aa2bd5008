"""The backend contract: :class:`Backend`, the hooks every transport implements, and the optional ones.

A transport is one object, a subclass of :class:`Backend` that implements
every method marked abstract here; :class:`~spmd.comms.comm.Comm` holds it
and calls its hooks after its own checks.  What is true when a hook is called
(checked arguments, their order, the results) is in docs/comms.md, "The hooks".
A backend reads only what it defines: the attributes declared here, set by its
constructor, and its own.
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING

import numpy as np

from spmd.errors import CollectiveError, is_peer_lost
from spmd.comms.arrays import byte_view

if TYPE_CHECKING:
    from spmd.comms.state.caches import Caches

__all__ = ["Backend"]


class Backend(abc.ABC):
    """The hooks a transport implements (abstract) or may override (the rest).

    Long because its one job is: the contract, each hook with its docstring.
    """

    #: The transport's name: "serial", "gloo", "nccl" or "mpi" (torch's own mpi: "mpi" too).
    name: str = ""
    #: This process's rank among the backend's ranks, and how many there are.
    rank: int
    size: int
    #: Where the backend's arrays live: "cpu", or a CUDA device for nccl.
    device: str = "cpu"
    #: Seconds init and each call may wait; None when unbounded.
    timeout: float | None = None
    #: Every piece of performance state kept for this group of ranks (spmd.comms.state.caches).
    caches: Caches
    #: The largest tag the backend's point-to-point messages may carry.
    max_tag: int = 2**31 - 1
    #: Data of at most this many bytes travels inside its header's message (spmd.comms.p2p):
    #: only for backends whose receive takes a message shorter than its buffer (mpi, gloo).
    inline_bytes: int = 0
    #: Whether the backend's works progress only when waited for (gloo): immediate
    #: receives then wait for their header in a thread of their own.
    receives_in_threads: bool = False

    # -- what every backend implements ------------------------------------------------
    # Arguments as docs/comms.md says: checked, in the order data, root,
    # op, out, async_op; a Handle back when async_op is true.

    @abc.abstractmethod
    def broadcast(self, x, root, async_op):
        """Copy root's x into x on every rank, in place; return x."""

    @abc.abstractmethod
    def reduce(self, x, root, op, async_op):
        """Reduce x into root's x in place (other ranks' x unchanged); return x."""

    @abc.abstractmethod
    def all_reduce(self, x, op, async_op):
        """Reduce x into every rank's x in place; return x."""

    @abc.abstractmethod
    def scatter(self, parts, whole, layout, root, out, async_op):
        """Return this rank's chunk (of layout's kind), in out when given.

        On root, parts is the list of size chunks (whole None), or whole is
        one array to cut by layout.lengths (parts None); elsewhere both are None.
        """

    @abc.abstractmethod
    def gather(self, x, lengths, root, out, async_op):
        """Return every rank's x, a list in rank order, on root (views of out when given); None elsewhere."""

    @abc.abstractmethod
    def all_gather(self, x, lengths, out, async_op):
        """Return every rank's x as a list in rank order (views of out when given)."""

    @abc.abstractmethod
    def barrier(self):
        """Block until every rank has called it."""

    @abc.abstractmethod
    def allgather_ints(self, row):
        """Return a (size, len(row)) int64 numpy array of every rank's row (valid until the next call)."""

    @abc.abstractmethod
    def broadcast_ints(self, ints, root):
        """Copy root's int64 numpy array ints into ints on every rank; return it."""

    @abc.abstractmethod
    def broadcast_object(self, obj, root):
        """Return root's picklable obj on every rank."""

    @abc.abstractmethod
    def gather_object(self, obj, root):
        """Return the list of every rank's obj on root, None elsewhere."""

    @abc.abstractmethod
    def all_gather_object(self, obj):
        """Return the list of every rank's obj on every rank."""

    @abc.abstractmethod
    def scatter_object(self, objs, root):
        """Return this rank's item of root's list of size objects (objs is None off root)."""

    @abc.abstractmethod
    def all_to_all(self, parts, whole, sent, layout, out, async_op):
        """Send chunk j (of parts, or of whole cut by the lengths sent) to rank j; return the list received.

        layout.lengths[i] is how many rows rank i sends here; the list
        holds views of out when given.
        """

    @abc.abstractmethod
    def reduce_scatter(self, x, lengths, op, async_op):
        """Reduce x over ranks; return this rank's block (dim-0 blocks of lengths) as a new array."""

    @abc.abstractmethod
    def scan(self, x, exclusive, op, async_op):
        """Replace x in place by op over ranks 0..rank (exclusive: 0..rank-1; rank 0's x then any); return x."""

    @abc.abstractmethod
    def send(self, x, dst, tag, async_op):
        """Send contiguous array x to rank dst under this backend tag; None, or a Handle when async_op."""

    @abc.abstractmethod
    def recv(self, x, src, tag, async_op):
        """Receive into contiguous array x from rank src (None: any) under this tag; return the sender's rank.

        With async_op, a Handle whose wait() gives the sender's rank.
        """

    @abc.abstractmethod
    def split(self, color, key):
        """Return the backend of the ranks that passed this color (ordered by key), None for color None."""

    @abc.abstractmethod
    def free(self):
        """Release this backend that split made (its ranks call it together; never the world's)."""

    # -- optional hooks: fast paths, devices, release --------------------------------
    # Direct hooks return (fn, args) with fn(*args) running the call (and, for
    # scatter and the gathers, giving its result), or None to leave the call to
    # the general hook.  Offered blocking calls only, with debug and trace off,
    # before Comm's checks: root is checked, but x, out and op come as the
    # caller gave them.  The rule that makes this safe: a direct hook takes
    # only what it can move correctly as it is (contiguous CPU arrays of a
    # dtype and op it handles, an out of the right kind, dtype and shape) and
    # returns None for anything else, a list, a non-contiguous view, an
    # unknown op or dtype included; the call then takes the general path,
    # whose checks raise the error that names the problem.
    # tests/comms/test_conformance.py offers every backend's direct hooks
    # what they cannot take.

    def direct_broadcast(self, x, root):
        """Offer a blocking broadcast to go by address."""
        return None

    def direct_reduce(self, x, root, op):
        """Offer a blocking reduce to go by address."""
        return None

    def direct_all_reduce(self, x, op):
        """Offer a blocking all_reduce (x an array, or a list for coalesce to handle) to go by address."""
        return None

    def direct_scatter(self, chunks, root, out):
        """Offer a blocking scatter(equal=True, out=out) to go by address (chunks as root passed them)."""
        return None

    def direct_gather(self, x, root, out):
        """Offer a blocking gather(equal=True) to go by address (out may be None)."""
        return None

    def direct_all_gather(self, x, out):
        """Offer a blocking all_gather(equal=True, out=out) to go by address."""
        return None

    def check_device(self, x, what):
        """Raise unless x lives where this backend can send it (CPU here)."""
        if not isinstance(x, np.ndarray) and not x.is_cpu:
            raise CollectiveError(
                f"{what} is on {x.device} but the {self.name} backend works on CPU tensors; "
                "move it with .cpu(), or use the nccl backend for CUDA tensors"
            )

    def mover(self, arrays):
        """Return an object that packs arrays into a flat buffer and back in one call, or None.

        It has ``pack(flat)``, ``unpack(flat)`` and ``nbytes``;
        the arrays are all of one kind and dtype, on the CPU.  None (here):
        the coalesced all_reduce groups the arrays and copies them one by one.
        """
        return None

    def close(self):
        """Release what the backend holds; the runtime calls this at finalize."""

    def note_stuck(self, call, why=""):
        """Tell the other ranks' timeout reports that this rank was in call (a Call)."""

    def peers_report(self, call):
        """Say where the other ranks were when call (a Call) timed out, if knowable."""
        return None

    def is_timeout(self, exc):
        """Tell whether exc, a RuntimeError from this backend, is the backend's own timeout (none here)."""
        return False

    def is_peer_lost(self, exc):
        """Tell whether exc, a RuntimeError from this backend, says a peer died or hung up.

        Here by :func:`spmd.errors.is_peer_lost`: the words gloo, MPI and the
        operating system use for a connection the other side closed.
        """
        return is_peer_lost(exc)

    def bytes_of(self, c):
        """Return contiguous CPU array or tensor c's memory as a writable 1-d numpy uint8 array."""
        return byte_view(c)
