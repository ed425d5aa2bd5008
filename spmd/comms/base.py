"""The communicator interface, and the contract every backend implements.

Every public method lives here, and only here; a backend never overrides
one.  A call goes through three steps:

1. **Checks, once.**  The public method checks its arguments and raises
   :class:`~spmd.errors.CollectiveError` naming the problem and the fix.
2. **The direct hook.**  A blocking call with debug and trace off is
   first offered to the backend's ``_direct_<name>`` hook, which may take
   it by address (no views, copies or closures).  It returns
   ``(fn, args)``, where ``fn(*args)`` runs the collective, or ``None`` to
   decline.  For the in-place collectives (broadcast, reduce, all_reduce)
   the call's result is ``x``; for scatter and the gathers it is what
   ``fn(*args)`` returns.  Direct hooks get ``x``
   and ``out`` *unchecked* (they must decline anything but the plain
   contiguous arrays they move), ``root`` checked, and ``op`` as the
   caller spelled it (decline a name you do not know).
3. **The general hook.**  Otherwise the call goes to ``_<name>``.

Either way the hook runs through :meth:`Comm._call`, the one place that
numbers the call, keeps its fingerprint, runs debug mode's cross-rank
check and the trace, and turns a backend's errors into spmd's: its own
timeout into :class:`~spmd.errors.CollectiveTimeout`, a lost peer into
:class:`~spmd.errors.PeerLostError`, anything else into
:class:`~spmd.errors.CommunicationError` (the backend's error chained);
an :class:`~spmd.errors.SpmdError` raised inside goes on as it is.  The
handle of an async call is the call's: its ``wait()`` is bounded by the
timeout (the mpi watcher counts it) and converted the same way.  Scatter
and the gathers first exchange array descriptions (``_allgather_ints``,
``_broadcast_ints``) through :meth:`Comm._describing`, which the timeout
sees as part of the call.

The general hooks' convention (what is true when a hook is called):

- arguments come in one order: the data (``x``; scatter's ``parts`` and
  ``whole``; the gathers' ``lengths``), then ``root``, ``op``, ``out``,
  and ``async_op`` last;
- ``x`` is a torch tensor or numpy array on this backend's device
  (``_check_device``), possibly non-contiguous, of any dtype;
- ``root`` is an int in ``range(size)``; ``op`` is one of
  ``arrays.OPS`` and suits x's dtype ("avg" only for floating types);
- ``lengths`` is every rank's length along dim 0 (rows of one dtype and
  trailing shape: checked across ranks); scatter's ``layout`` is a
  :class:`Layout` of the chunk every rank receives;
- ``out`` is ``None`` or a contiguous array of the result's kind, dtype
  and shape (checked): the result must land in it;
- with ``async_op=False`` a hook returns the result; with ``async_op=True``
  it returns a :class:`~spmd.comms.handle.Handle` whose ``wait()`` gives
  it (``Done(result)`` if the work is already over).

Results: broadcast, reduce, all_reduce, scan and exscan work in place
and return ``x``; scatter returns this rank's chunk (of the root's kind:
numpy or torch); gather returns the list of every rank's rows on root and
``None`` elsewhere; all_gather and all_to_all the list everywhere;
reduce_scatter this rank's block, a new array.

Point to point (:mod:`spmd.comms.p2p.methods`) needs two hooks only, ``_send`` and
``_recv``, which move one contiguous array under a backend tag; the mixin
builds messages (a header describing the array, then its data), maps user
tags away from spmd's own, and checks what arrives.  ``_recv`` with
``src=None`` receives from any rank and returns who sent.  Calls go through
``_call(..., collective=False)``: counted and traced like any other, but
never compared across ranks.

**Writing a backend.**  One file in ``spmd/comms/``: subclass
:class:`Comm`, set ``backend``, call ``Comm.__init__(rank, size,
placement, device, timeout, monitor)``, and implement every method
marked abstract below.  Optionally override the direct hooks (fast
paths), ``_check_device`` (where arrays must live), ``_mover``
(coalesced all_reduce), ``_close`` (release at finalize) and
``_note_stuck``/``_peers_report`` (timeout reports) and ``_is_timeout``
(which of the backend's errors are its own timeout).  Then teach
``spmd.runtime.start`` to start it, add its name to ``spmd.runtime.backends.BACKENDS``,
and add it to the conformance suite (``tests/comms/test_conformance.py``) if
it can run in one process.  :mod:`spmd.comms.backends.serial` is the smallest
example.
"""

import abc

import numpy as np

from spmd.errors import CollectiveError, SpmdError, is_peer_lost
from spmd.failfast.calls import Monitor
from spmd.comms.state import meta
from spmd.comms.arrays import check_array, dtype_name
from spmd.comms.state.caches import Caches
from spmd.comms.api.collectives import Collectives
from spmd.comms.api.exchanges import Exchanges
from spmd.comms.handle import Done, Handle
from spmd.comms.p2p.incoming import header_buffer
from spmd.comms.state.meta import Layout
from spmd.comms.api.objects import Objects
from spmd.comms.p2p.methods import PointToPoint

__all__ = ["Comm", "Handle", "Done", "Layout"]


class Comm(Collectives, Exchanges, PointToPoint, Objects, abc.ABC):
    """A group of ranks and the collectives among them.

    The public methods come by family from the mixins: :mod:`~spmd.comms.api.collectives`,
    :mod:`~spmd.comms.api.exchanges` (all_to_all, reduce_scatter, scan),
    :mod:`~spmd.comms.p2p.methods` (point to point), :mod:`~spmd.comms.api.objects`.
    """

    #: Name of the backend: "serial", "gloo", "nccl" or "mpi".
    backend = None
    #: The largest tag the backend's point-to-point messages may carry.
    _max_tag = 2**31 - 1

    def __init__(self, rank, size, placement=None, device="cpu", timeout=None, monitor=None, caches=None):
        self._mon = monitor if monitor is not None else Monitor()
        #: Every piece of performance state this communicator keeps (spmd.comms.state.caches).
        self._caches = caches if caches is not None else Caches(size)
        self.rank = rank
        self.size = size
        self.device = device
        #: Seconds init and each collective may wait; None when unbounded.
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
        # Point to point (spmd.comms.p2p.methods): pending immediate receives, and where a blocking
        # receive's header (and inline data) lands, one receive at a time.
        self._incoming = []
        self._recv_header = header_buffer(self)
        self._recv_row = self._recv_header[: meta.WIDTH]
        self._recv_tail = self._recv_header.view(np.uint8)[8 : meta.WIDTH * 8]

    def __repr__(self):
        return f"<{type(self).__name__} rank {self.rank} of {self.size}, backend {self.backend}>"

    # -- the contract: what every backend implements --------------------------------
    # Arguments as the module docstring says: checked, in the order data, root,
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

    def _note_stuck(self, fp, why=""):
        """Tell the other ranks' timeout reports that this rank was in collective fp."""

    def _peers_report(self, fp):
        """Say where the other ranks were when collective fp timed out, if knowable."""
        return None

    def _is_timeout(self, exc):
        """Tell whether exc, a RuntimeError from this backend, is the backend's own timeout (none here)."""
        return False

    # -- every collective goes through here ---------------------------------------

    def _call(self, hook, args, name, x=None, root=None, op=None, async_op=False, collective=True):
        """Run hook(*args) as this communicator's next call; return its result.

        The one bookkeeping path of every call, direct or general,
        collective or point to point: the sequence number and fingerprint
        (for timeout reports), debug mode's cross-rank check (collectives
        only) and the trace when on, and a backend's errors turned into
        spmd's (:meth:`_converted`; an SpmdError raised inside goes on as
        it is).  The Handle of an async call becomes the call's: its wait()
        is bounded and converted the same way (:meth:`_waiting`).  For
        point to point, root is the peer and op the tag.
        """
        mon = self._mon
        fp = mon.note(name, x, root, op)
        mon.busy = fp[0]
        try:
            result = mon.run(self, fp, hook, args, x, async_op, collective) if mon.active else hook(*args)
        except SpmdError:
            raise
        except RuntimeError as exc:
            raise self._converted(exc, fp) from exc
        finally:
            mon.busy = 0
        if async_op and not result._done:
            result._owner, result._fp = self, fp
        return result

    def _describing(self, name, x, root, fn, *args):
        """Run fn(*args), the description exchange that opens collective name, as part of it.

        The exchange is the first wait of the call, so a rank whose peers
        never come waits here: the timeout (the mpi watcher, or the torch
        backend's own) must see it, and report it under the call's number.
        """
        mon = self._mon
        fp = mon.upcoming(name, x, root)
        mon.busy = fp[0]
        try:
            return fn(*args)
        except SpmdError:
            raise
        except RuntimeError as exc:
            raise self._converted(exc, fp) from exc
        finally:
            mon.busy, mon.pending = 0, None

    def _waiting(self, fn, fp, block=True):
        """Run fn(), the wait (block) or test of async call fp's handle, as part of that call.

        A wait is what the mpi watcher counts (busy is the call's number,
        and waiting its fingerprint, so the report names the call and says
        it was in wait()); either way a backend's error is converted as in
        the call itself.
        """
        mon = self._mon
        if block:
            before = mon.busy, mon.waiting
            mon.waiting, mon.busy = fp, fp[0]
        try:
            return fn()
        except SpmdError:
            raise
        except RuntimeError as exc:
            raise self._converted(exc, fp, waiting=True) from exc
        finally:
            if block:
                mon.busy, mon.waiting = before

    def _converted(self, exc, fp, waiting=False):
        """Return the spmd error that a backend's RuntimeError exc in call fp stands for.

        A CollectiveTimeout when the backend says it is its own timeout
        (:meth:`_is_timeout`, by what the error is, never by a word in it),
        a PeerLostError when a peer died or hung up, else a
        CommunicationError; each names the call and quotes exc, which the
        caller chains.
        """
        if self._is_timeout(exc):
            from spmd.failfast.abort import stacks_report

            stacks_report()  # where every rank is at this hang, printed once by rank 0 (every backend)
            return self._mon.timeout_error(self, fp, exc, self._peers_report(fp), waiting)
        lost = is_peer_lost(exc)
        if lost:  # a peer that timed out may be waiting to hear where this rank was
            self._note_stuck(fp, "(a peer closed its connection)")
        return self._mon.failure(self, fp, exc, lost, waiting)

    # -- checks --------------------------------------------------------------

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
        check_array(x, what)
        self._check_device(x, what)
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

    @staticmethod
    def _split(x, sizes):
        """Cut x along dim 0 into views of the given lengths."""
        out, start = [], 0
        for n in sizes:
            out.append(x[start : start + n])
            start += n
        return out
