"""The communicator interface: argument checks once, then a backend hook.

Every public collective validates its arguments here and calls a
``_name`` hook that each backend implements.  A hook given
``async_op=False`` does the work and returns the result; given
``async_op=True`` it returns a :class:`Handle` whose ``wait()`` gives
the result.
"""

import numpy as np

from ..errors import CollectiveError, is_peer_lost
from ..monitor import Monitor
from . import meta
from .arrays import check_array, check_op, dtype_name, split_sizes

__all__ = ["Comm", "Handle", "Done"]


class Handle:
    """A collective in flight; ``wait()`` returns its result."""

    __slots__ = ("_wait", "_test", "_finish", "_done", "_result")

    def __init__(self, wait, test, finish):
        self._wait, self._test, self._finish = wait, test, finish
        self._done, self._result = False, None

    def wait(self):
        """Block until the collective is complete and return its result."""
        if not self._done:
            self._wait()
            self._done = True
            self._result = self._finish()
        return self._result

    def is_completed(self):
        """Tell, without blocking, whether the collective has completed."""
        if not self._done and self._test():
            self.wait()
        return self._done

    def __repr__(self):
        return f"<Handle {'done' if self._done else 'pending'}>"


class Done(Handle):
    """A handle for work that finished before it was returned."""

    __slots__ = ()

    def __init__(self, result):
        self._done, self._result = True, result


class Comm:
    """A group of ranks and the collectives among them."""

    #: Name of the backend: "serial", "gloo", "nccl" or "mpi".
    backend = None

    def __init__(self, rank, size, placement=None, device="cpu", timeout=None, monitor=None):
        self._mon = monitor if monitor is not None else Monitor()
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
        self._descs = meta.Descriptions(size)  # array descriptions, cached per shape
        # Where non-root ranks receive scatter's header (read before the next call).
        self._header_buffer = np.zeros(1 + meta.WIDTH + size, dtype=np.int64)

    def __repr__(self):
        return f"<{type(self).__name__} rank {self.rank} of {self.size}, backend {self.backend}>"

    def _close(self):
        """Release what the backend holds; the runtime calls this at finalize."""

    def _mover(self, arrays):
        """Return an object that packs arrays into a flat buffer and back in one call, or None.

        It has ``pack(flat)``, ``unpack(flat)`` and ``nbytes``;
        the arrays are all of one kind and dtype, on the CPU.  None (here):
        the coalesced all_reduce groups the arrays and copies them one by one.
        """
        return None

    # -- every collective goes through here ---------------------------------------

    def _call(self, hook, args, name, x=None, root=None, op=None, async_op=False):
        """Run a backend hook as collective number seq, turning timeouts into errors."""
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

    def _note_stuck(self, fp, why=""):
        """Tell the other ranks' timeout reports that this rank was in collective fp."""

    def _peers_report(self, fp):
        """Say where the other ranks were when collective fp timed out, if knowable."""
        return None

    # -- checks --------------------------------------------------------------

    def _root(self, root):
        if not isinstance(root, int) or isinstance(root, bool) or not 0 <= root < self.size:
            raise CollectiveError(
                f"root {root!r} is out of range: this communicator has ranks 0 to {self.size - 1}"
            )
        return root

    def _array(self, x, what="x"):
        check_array(x, what)
        self._check_device(x, what)
        return x

    def _check_device(self, x, what):
        """Raise unless x lives where this backend can send it (CPU here)."""
        if not isinstance(x, np.ndarray) and not x.is_cpu:
            raise CollectiveError(
                f"{what} is on {x.device} but the {self.backend} backend works on CPU tensors; "
                "move it with .cpu(), or use the nccl backend for CUDA tensors"
            )

    # -- the six collectives ---------------------------------------------------

    def broadcast(self, x, root=0, async_op=False):
        """Copy root's x into x on every rank, in place; return x."""
        root = self._root(root)
        return self._call(self._broadcast, (self._array(x), root, async_op), "broadcast", x, root, None, async_op)

    def reduce(self, x, root=0, op="sum", async_op=False):
        """Combine x over ranks into root's x, in place; other ranks' x stay unchanged."""
        root, op = self._root(root), check_op(op, self._array(x))
        return self._call(self._reduce, (x, root, op, async_op), "reduce", x, root, op, async_op)

    def all_reduce(self, x, op="sum", async_op=False, chunk_bytes=None):
        """Combine x over ranks into every rank's x, in place; return x.

        x may be a list of arrays: they are reduced as one flat buffer per
        dtype, one call instead of one per array.  With ``chunk_bytes`` a
        large x is reduced in pieces of at most that size (blocking), so
        the backend's scratch memory stays bounded.
        """
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
        if out is not None:
            self._array(out, "out")
        if equal:
            return self._scatter_equal(chunks, root, async_op, out)
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
        kind, dtype, trail, lengths = self._descs.header(header)
        if out is not None:
            self._check_out(out, kind, dtype, (lengths[self.rank],) + trail, "scatter")
        header = {"kind": kind, "dtype": dtype, "trail": trail, "lengths": lengths, "out": out}
        args = (parts, whole, header, root, async_op)
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
        kind, dtype = self._kind_dtype(like)
        header = {"kind": kind, "dtype": dtype, "trail": tuple(like.shape[1:]), "lengths": lengths, "out": out}
        return self._call(self._scatter, (parts, whole, header, root, async_op), "scatter", like, root, "equal", async_op)

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
        lengths = self._lengths(x, "gather", equal)
        out = self._gather_out(x, lengths, out, "gather") if self.rank == root else None
        op = "equal" if equal else None
        return self._call(self._gather, (x, lengths, root, async_op, out), "gather", x, root, op, async_op)

    def all_gather(self, x, async_op=False, *, equal=False, out=None):
        """Collect every rank's x on every rank, as a list in rank order.

        ``equal`` and ``out`` work as for :meth:`gather`.
        """
        lengths = self._lengths(x, "all_gather", equal)
        out = self._gather_out(x, lengths, out, "all_gather")
        op = "equal" if equal else None
        return self._call(self._all_gather, (x, lengths, async_op, out), "all_gather", x, None, op, async_op)

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
