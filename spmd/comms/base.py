"""The communicator interface: argument checks once, then a backend hook.

Every public collective validates its arguments here and calls a
``_name`` hook that each backend implements.  A hook given
``async_op=False`` does the work and returns the result; given
``async_op=True`` it returns a :class:`Handle` whose ``wait()`` gives
the result.
"""

import numpy as np

from ..errors import CollectiveError
from ..monitor import Monitor
from . import meta
from .arrays import check_array, check_op, split_sizes

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

    def _raise_timeout(self, exc, fp):
        """Re-raise a backend's RuntimeError, as a CollectiveTimeout when it says it timed out."""
        text = str(exc).lower()
        if "timed out" in text or "timeout" in text:
            raise self._mon.timeout_error(self, fp, exc, self._peers_report(fp)) from None
        raise exc

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

    def scatter(self, chunks=None, root=0, async_op=False):
        """Send root's i-th chunk to rank i and return this rank's chunk.

        On root, chunks is a list of ``size`` arrays, or one array split
        along dim 0 the way ``numpy.array_split`` does.  Other ranks pass
        None.  Chunk lengths along dim 0 may differ.
        """
        root = self._root(root)
        parts, whole, error = None, None, None
        if self.rank == root:
            try:
                parts, whole, lengths = self._scatter_parts(chunks)
                first = whole if parts is None else parts[0]
                header = meta.scatter_header(first, lengths)
            except CollectiveError as exc:
                header, error = meta.error_header(self.size), str(exc)
        else:
            header = self._header_buffer
        self._broadcast_ints(header, root)
        if header[0]:
            raise CollectiveError(self._broadcast_object(error, root))
        kind, dtype, trail, lengths = self._descs.header(header)
        header = {"kind": kind, "dtype": dtype, "trail": trail, "lengths": lengths}
        args = (parts, whole, header, root, async_op)
        return self._call(self._scatter, args, "scatter", None, root, None, async_op)

    def _lengths(self, x, what):
        """Exchange array descriptions; return every rank's dim-0 length or raise everywhere."""
        self._array(x)
        row, same = self._descs.row(x)
        return self._descs.lengths(x, self._allgather_ints(row), same, what)

    def gather(self, x, root=0, async_op=False):
        """Collect every rank's x on root: a list on root, None elsewhere.

        Lengths along dim 0 may differ between ranks.
        """
        root = self._root(root)
        lengths = self._lengths(x, "gather")
        return self._call(self._gather, (x, lengths, root, async_op), "gather", x, root, None, async_op)

    def all_gather(self, x, async_op=False):
        """Collect every rank's x on every rank, as a list in rank order."""
        lengths = self._lengths(x, "all_gather")
        return self._call(self._all_gather, (x, lengths, async_op), "all_gather", x, None, None, async_op)

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
