"""The backend contract: the hooks every backend implements, and the optional ones.

A backend subclasses :class:`~spmd.comms.base.Comm` and implements every
method marked abstract here; what is true when a hook is called (checked
arguments, their order, the results) is in docs/comms.md, "The hooks".
"""

import abc

import numpy as np

from spmd.errors import CollectiveError, is_peer_lost

__all__ = ["Contract"]


class Contract(abc.ABC):
    """The hooks a backend implements (abstract) or may override (the rest)."""

    # -- what every backend implements ------------------------------------------------
    # Arguments as docs/comms.md says: checked, in the order data, root,
    # op, out, async_op; a Handle back when async_op is true.

    @abc.abstractmethod
    def _broadcast(self, x, root, async_op):
        """Copy root's x into x on every rank, in place; return x."""

    @abc.abstractmethod
    def _reduce(self, x, root, op, async_op):
        """Reduce x into root's x in place (other ranks' x unchanged); return x."""

    @abc.abstractmethod
    def _all_reduce(self, x, op, async_op):
        """Reduce x into every rank's x in place; return x."""

    @abc.abstractmethod
    def _scatter(self, parts, whole, layout, root, out, async_op):
        """Return this rank's chunk (of layout's kind), in out when given.

        On root, parts is the list of size chunks (whole None), or whole is
        one array to cut by layout.lengths (parts None); elsewhere both are None.
        """

    @abc.abstractmethod
    def _gather(self, x, lengths, root, out, async_op):
        """Return every rank's x, a list in rank order, on root (views of out when given); None elsewhere."""

    @abc.abstractmethod
    def _all_gather(self, x, lengths, out, async_op):
        """Return every rank's x as a list in rank order (views of out when given)."""

    @abc.abstractmethod
    def _barrier(self):
        """Block until every rank has called it."""

    @abc.abstractmethod
    def _allgather_ints(self, row):
        """Return a (size, len(row)) int64 numpy array of every rank's row (valid until the next call)."""

    @abc.abstractmethod
    def _broadcast_ints(self, ints, root):
        """Copy root's int64 numpy array ints into ints on every rank; return it."""

    @abc.abstractmethod
    def _broadcast_object(self, obj, root):
        """Return root's picklable obj on every rank."""

    @abc.abstractmethod
    def _gather_object(self, obj, root):
        """Return the list of every rank's obj on root, None elsewhere."""

    @abc.abstractmethod
    def _all_gather_object(self, obj):
        """Return the list of every rank's obj on every rank."""

    @abc.abstractmethod
    def _scatter_object(self, objs, root):
        """Return this rank's item of root's list of size objects (objs is None off root)."""

    @abc.abstractmethod
    def _all_to_all(self, parts, whole, sent, layout, out, async_op):
        """Send chunk j (of parts, or of whole cut by the lengths sent) to rank j; return the list received.

        layout.lengths[i] is how many rows rank i sends here; the list
        holds views of out when given.
        """

    @abc.abstractmethod
    def _reduce_scatter(self, x, lengths, op, async_op):
        """Reduce x over ranks; return this rank's block (dim-0 blocks of lengths) as a new array."""

    @abc.abstractmethod
    def _scan(self, x, exclusive, op, async_op):
        """Replace x in place by op over ranks 0..rank (exclusive: 0..rank-1; rank 0's x then any); return x."""

    @abc.abstractmethod
    def _send(self, x, dst, tag, async_op):
        """Send contiguous array x to rank dst under this backend tag; None, or a Handle when async_op."""

    @abc.abstractmethod
    def _recv(self, x, src, tag, async_op):
        """Receive into contiguous array x from rank src (None: any) under this tag; return the sender's rank.

        With async_op, a Handle whose wait() gives the sender's rank.
        """

    @abc.abstractmethod
    def _split_comm(self, color, key):
        """Return the communicator of the ranks that passed this color (ordered by key), None for color None."""

    @abc.abstractmethod
    def _free(self):
        """Release this communicator that split made (its ranks call it together; never the world)."""

    # -- optional hooks: fast paths, devices, release --------------------------------
    # Direct hooks return (fn, args) with fn(*args) running the call (and, for
    # scatter and the gathers, giving its result), or None to leave the call to
    # the general hook.  Offered blocking calls only,
    # with debug and trace off; x and out unchecked, root checked, op as given.

    def _direct_broadcast(self, x, root):
        """Offer a blocking broadcast to go by address."""
        return None

    def _direct_reduce(self, x, root, op):
        """Offer a blocking reduce to go by address."""
        return None

    def _direct_all_reduce(self, x, op):
        """Offer a blocking all_reduce (x an array, or a list for coalesce to handle) to go by address."""
        return None

    def _direct_scatter(self, chunks, root, out):
        """Offer a blocking scatter(equal=True, out=out) to go by address (chunks as root passed them)."""
        return None

    def _direct_gather(self, x, root, out):
        """Offer a blocking gather(equal=True) to go by address (out may be None)."""
        return None

    def _direct_all_gather(self, x, out):
        """Offer a blocking all_gather(equal=True, out=out) to go by address."""
        return None

    def _check_device(self, x, what):
        """Raise unless x lives where this backend can send it (CPU here)."""
        if not isinstance(x, np.ndarray) and not x.is_cpu:
            raise CollectiveError(
                f"{what} is on {x.device} but the {self.backend} backend works on CPU tensors; "
                "move it with .cpu(), or use the nccl backend for CUDA tensors"
            )

    def _mover(self, arrays):
        """Return an object that packs arrays into a flat buffer and back in one call, or None.

        It has ``pack(flat)``, ``unpack(flat)`` and ``nbytes``;
        the arrays are all of one kind and dtype, on the CPU.  None (here):
        the coalesced all_reduce groups the arrays and copies them one by one.
        """
        return None

    def _close(self):
        """Release what the backend holds; the runtime calls this at finalize."""

    def _note_stuck(self, call, why=""):
        """Tell the other ranks' timeout reports that this rank was in call (a Call)."""

    def _peers_report(self, call):
        """Say where the other ranks were when call (a Call) timed out, if knowable."""
        return None

    def _is_timeout(self, exc):
        """Tell whether exc, a RuntimeError from this backend, is the backend's own timeout (none here)."""
        return False

    def _is_peer_lost(self, exc):
        """Tell whether exc, a RuntimeError from this backend, says a peer died or hung up.

        Here by :func:`spmd.errors.is_peer_lost`: the words gloo, MPI and the
        operating system use for a connection the other side closed.
        """
        return is_peer_lost(exc)
