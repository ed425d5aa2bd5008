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
check and the trace, and turns a backend's timeout into
:class:`~spmd.errors.CollectiveTimeout`.  Scatter and the gathers first
exchange array descriptions (``_allgather_ints``, ``_broadcast_ints``)
through :meth:`Comm._describing`, which the timeout sees as part of the
call.

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

Results: broadcast, reduce and all_reduce work in place and return
``x``; scatter returns this rank's chunk (of the root's kind: numpy or
torch); gather returns the list of every rank's rows on root and ``None``
elsewhere; all_gather the list everywhere.

**Writing a backend.**  One file in ``spmd/comms/``: subclass
:class:`Comm`, set ``backend``, call ``Comm.__init__(rank, size,
placement, device, timeout, monitor)``, and implement every method
marked abstract below.  Optionally override the direct hooks (fast
paths), ``_check_device`` (where arrays must live), ``_mover``
(coalesced all_reduce), ``_close`` (release at finalize) and
``_note_stuck``/``_peers_report`` (timeout reports).  Then teach
``spmd.runtime`` to start it, add its name to ``spmd.backends.BACKENDS``,
and add it to the conformance suite (``tests/test_conformance.py``) if
it can run in one process.  :mod:`spmd.comms.serial` is the smallest
example.
"""

import abc
from typing import NamedTuple

import numpy as np

from ..errors import CollectiveError, is_peer_lost
from ..monitor import Monitor
from . import meta
from .arrays import check_array, check_op, dtype_name, split_sizes
from .caches import Caches
from .handle import Done, Handle

__all__ = ["Comm", "Handle", "Done", "Layout"]


class Layout(NamedTuple):
    """What every rank receives from scatter: kind, dtype, shape after dim 0, each rank's length."""

    kind: str  # "numpy" or "torch"
    dtype: str  # dtype_name(): "float32", "bfloat16", ...
    trail: tuple
    lengths: list


class Comm(abc.ABC):
    """A group of ranks and the collectives among them."""

    #: Name of the backend: "serial", "gloo", "nccl" or "mpi".
    backend = None

    def __init__(self, rank, size, placement=None, device="cpu", timeout=None, monitor=None, caches=None):
        self._mon = monitor if monitor is not None else Monitor()
        #: Every piece of performance state this communicator keeps (spmd.comms.caches).
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

    # -- every collective goes through here ---------------------------------------

    def _call(self, hook, args, name, x=None, root=None, op=None, async_op=False):
        """Run hook(*args) as this communicator's next collective; return its result.

        The one bookkeeping path of every call, direct or general: the
        sequence number and fingerprint (for timeout reports), debug
        mode's check and the trace when on, and a backend's timeout
        turned into CollectiveTimeout.
        """
        mon = self._mon
        fp = mon.note(name, x, root, op)
        mon.busy = fp[0]
        try:
            if mon.active:
                return mon.run(self, fp, hook, args, x, async_op)
            return hook(*args)
        except RuntimeError as exc:
            self._raise_timeout(exc, fp)
        finally:
            mon.busy = 0

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
        except RuntimeError as exc:
            self._raise_timeout(exc, fp)
        finally:
            mon.busy, mon.pending = 0, None

    def _raise_timeout(self, exc, fp):
        """Re-raise a backend's RuntimeError, as a CollectiveTimeout when it says it timed out."""
        text = str(exc).lower()
        if "timed out" in text or "timeout" in text:
            raise self._mon.timeout_error(self, fp, exc, self._peers_report(fp)) from None
        if is_peer_lost(exc):  # a peer that timed out may be waiting to hear where this rank was
            self._note_stuck(fp, "(a peer closed its connection)")
        raise exc

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

    # -- the six collectives ---------------------------------------------------

    def broadcast(self, x, root=0, async_op=False):
        """Copy root's x into x on every rank, in place; return x."""
        root = self._root(root)
        if not async_op and not self._mon.active:
            go = self._direct_broadcast(x, root)
            if go is not None:
                self._call(go[0], go[1], "broadcast", x, root)
                return x
        return self._call(self._broadcast, (self._array(x), root, async_op), "broadcast", x, root, None, async_op)

    def reduce(self, x, root=0, op="sum", async_op=False):
        """Combine x over ranks into root's x, in place; other ranks' x stay unchanged."""
        root = self._root(root)
        if not async_op and not self._mon.active:
            go = self._direct_reduce(x, root, op)
            if go is not None:
                self._call(go[0], go[1], "reduce", x, root, op)
                return x
        op = check_op(op, self._array(x))
        return self._call(self._reduce, (x, root, op, async_op), "reduce", x, root, op, async_op)

    def all_reduce(self, x, op="sum", async_op=False, chunk_bytes=None):
        """Combine x over ranks into every rank's x, in place; return x.

        x may be a list of arrays: they are reduced as one flat buffer per
        dtype, one call instead of one per array.  With ``chunk_bytes`` a
        large x is reduced in pieces of at most that size (blocking), so
        the backend's scratch memory stays bounded.
        """
        if not async_op and chunk_bytes is None and not self._mon.active:
            go = self._direct_all_reduce(x, op)
            if go is not None:
                self._call(go[0], go[1], "all_reduce", x, None, op)
                return x
        if isinstance(x, (list, tuple)):
            from .coalesce import all_reduce_many

            return all_reduce_many(self, x, op, async_op)
        op = check_op(op, self._array(x))
        if chunk_bytes is not None and x.ndim and x.shape[0] > 1:
            from .coalesce import all_reduce_chunked, nbytes

            if nbytes(x) > chunk_bytes:
                result = all_reduce_chunked(self, x, op, chunk_bytes)
                return Done(result) if async_op else result
        return self._call(self._all_reduce, (x, op, async_op), "all_reduce", x, None, op, async_op)

    def scatter(self, chunks=None, root=0, async_op=False, *, equal=False, out=None):
        """Send root's i-th chunk to rank i and return this rank's chunk.

        On root, chunks is a list of ``size`` arrays, or one array split
        along dim 0 the way ``numpy.array_split`` does.  Other ranks pass
        None.  Chunk lengths along dim 0 may differ.

        With ``equal=True`` (on every rank) all chunks have one shape and
        root sends no description first: every rank other than root must
        then pass ``out``, the array to receive into.  ``out`` may be
        given in any case; the chunk lands in it and it is returned.
        Without it the chunk is new memory, or that of a large earlier
        result nothing refers to any more (``spmd.comms.results``).
        """
        root = self._root(root)
        if equal:
            if out is not None and not async_op and not self._mon.active:
                go = self._direct_scatter(chunks if self.rank == root else None, root, out)
                if go is not None:
                    return self._call(go[0], go[1], "scatter", out, root, "equal")
            if out is not None:
                self._array(out, "out")
            return self._scatter_equal(chunks, root, async_op, out)
        if out is not None:
            self._array(out, "out")
        parts, whole, error = None, None, None
        if self.rank == root:
            try:
                parts, whole, lengths = self._scatter_parts(chunks)
                first = whole if parts is None else parts[0]
                header = self._descs.scatter_header(first, lengths)
            except CollectiveError as exc:
                header, error = meta.error_header(self.size), str(exc)
        else:
            header = self._header_buffer
        self._describing("scatter", None, root, self._broadcast_ints, header, root)
        if header[0]:
            raise CollectiveError(self._describing("scatter", None, root, self._broadcast_object, error, root))
        layout = Layout(*self._descs.header(header))
        if out is not None:
            self._check_out(out, layout.kind, layout.dtype, (layout.lengths[self.rank],) + layout.trail, "scatter")
        args = (parts, whole, layout, root, out, async_op)
        return self._call(self._scatter, args, "scatter", None, root, None, async_op)

    def _scatter_equal(self, chunks, root, async_op, out):
        """scatter(equal=True): shapes known on every rank, so no header goes out."""
        parts, whole, like = None, None, out
        if self.rank == root:
            parts, whole, lengths = self._scatter_parts(chunks)
            first = whole if parts is None else parts[0]
            if lengths.count(lengths[0]) != self.size:
                raise CollectiveError(f"scatter(equal=True): chunk lengths differ ({lengths}); pass equal=False")
            like = first if parts is not None else first[: lengths[0]]
            if out is not None:
                self._check_out(out, *self._kind_dtype(like), tuple(like.shape), "scatter")
        elif out is None:
            raise CollectiveError(
                "scatter(equal=True): ranks other than root must pass out=, the array to receive "
                "their chunk into (it tells them the shape); or call scatter without equal=True"
            )
        else:
            lengths = [out.shape[0]] * self.size
        layout = Layout(*self._kind_dtype(like), tuple(like.shape[1:]), lengths)
        args = (parts, whole, layout, root, out, async_op)
        return self._call(self._scatter, args, "scatter", like, root, "equal", async_op)

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

    def _lengths(self, x, what, equal=False):
        """Exchange array descriptions; return every rank's dim-0 length or raise everywhere.

        With equal, nothing is exchanged: every rank is taken to have x's shape.
        """
        self._array(x)
        row, same = self._descs.row(x)
        if equal:
            if same is None:
                meta.check_rows([row], what)  # raises, naming what is wrong with x
            return [x.shape[0]] * self.size
        rows = self._describing(what, x, None, self._allgather_ints, row)
        return self._descs.lengths(x, rows, same, what)

    def _gather_out(self, x, lengths, out, what):
        if out is not None:
            self._array(out, "out")
            self._check_out(out, *self._kind_dtype(x), (sum(lengths),) + tuple(x.shape[1:]), what)
        return out

    def gather(self, x, root=0, async_op=False, *, equal=False, out=None):
        """Collect every rank's x on root: a list on root, None elsewhere.

        Lengths along dim 0 may differ between ranks.  With ``equal=True``
        (on every rank) all ranks' x have one shape and no descriptions
        are exchanged first (one collective fewer).  With ``out``, an
        array of every rank's rows one after another, root receives into
        it; the list returned holds views of it.  Without ``out`` the
        result is new memory, or that of a large earlier result nothing
        refers to any more (``spmd.comms.results``).
        """
        root = self._root(root)
        if equal and not async_op and not self._mon.active:
            go = self._direct_gather(x, root, out if self.rank == root else None)
            if go is not None:
                return self._call(go[0], go[1], "gather", x, root, "equal")
        lengths = self._lengths(x, "gather", equal)
        out = self._gather_out(x, lengths, out, "gather") if self.rank == root else None
        op = "equal" if equal else None
        return self._call(self._gather, (x, lengths, root, out, async_op), "gather", x, root, op, async_op)

    def all_gather(self, x, async_op=False, *, equal=False, out=None):
        """Collect every rank's x on every rank, as a list in rank order.

        ``equal`` and ``out`` work as for :meth:`gather`.
        """
        if equal and out is not None and not async_op and not self._mon.active:
            go = self._direct_all_gather(x, out)
            if go is not None:
                return self._call(go[0], go[1], "all_gather", x, None, "equal")
        lengths = self._lengths(x, "all_gather", equal)
        out = self._gather_out(x, lengths, out, "all_gather")
        op = "equal" if equal else None
        return self._call(self._all_gather, (x, lengths, out, async_op), "all_gather", x, None, op, async_op)

    def barrier(self):
        """Block until every rank has called barrier."""
        self._call(self._barrier, (), "barrier")

    def _scatter_parts(self, chunks):
        """On root: return (list of size arrays or None, whole array or None, lengths), or raise."""
        if chunks is None:
            raise CollectiveError("scatter: the root rank must pass the chunks, got None")
        if not isinstance(chunks, (list, tuple)):
            self._array(chunks, "scatter chunks")
            if chunks.ndim == 0:
                raise CollectiveError("scatter: cannot split a 0-d array; pass a list of chunks")
            if meta.dtype_code(chunks.dtype) < 0 or chunks.ndim > meta.MAX_TRAIL + 1:
                meta.check_rows([meta.encode(chunks)], "scatter")  # raises, naming it
            return None, chunks, split_sizes(chunks.shape[0], self.size)
        if len(chunks) != self.size:
            raise CollectiveError(f"scatter: expecting {self.size} chunks (one per rank), got {len(chunks)}")
        for i, c in enumerate(chunks):
            check_array(c, f"scatter chunk {i}")
            self._check_device(c, f"scatter chunk {i}")
        parts = list(chunks)
        first = parts[0]
        if (
            meta.dtype_code(first.dtype) < 0
            or not 0 < first.ndim <= meta.MAX_TRAIL + 1
            or any(p.dtype != first.dtype or p.shape[1:] != first.shape[1:] for p in parts)
        ):
            meta.check_rows([meta.encode(p) for p in parts], "scatter")  # raises, naming each
        return parts, None, [p.shape[0] for p in parts]

    @staticmethod
    def _split(x, sizes):
        """Cut x along dim 0 into views of the given lengths."""
        out, start = [], 0
        for n in sizes:
            out.append(x[start : start + n])
            start += n
        return out

    # -- objects -------------------------------------------------------------

    def broadcast_object(self, obj, root=0):
        """Return root's obj on every rank (pickled)."""
        root = self._root(root)
        return self._call(self._broadcast_object, (obj, root), "broadcast_object", None, root)

    def gather_object(self, obj, root=0):
        """Return the list of every rank's obj on root, None elsewhere."""
        root = self._root(root)
        return self._call(self._gather_object, (obj, root), "gather_object", None, root)

    def all_gather_object(self, obj):
        """Return the list of every rank's obj on every rank."""
        return self._call(self._all_gather_object, (obj,), "all_gather_object")

    def scatter_object(self, objs=None, root=0):
        """Return this rank's item of root's list of size objects."""
        root = self._root(root)
        error = None
        if self.rank == root:
            if objs is None or len(objs) != self.size:
                got = "None" if objs is None else len(objs)
                error = f"scatter_object: expecting {self.size} objects (one per rank), got {got}"
        error = self.broadcast_object(error, root)
        if error:
            raise CollectiveError(error)
        objs = list(objs) if self.rank == root else None
        return self._call(self._scatter_object, (objs, root), "scatter_object", None, root)

    # -- sub-communicators -----------------------------------------------------

    def split(self, color=0, key=None, *, ranks=None):
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
        return self._call(self._split_comm, (color, key), "split")
