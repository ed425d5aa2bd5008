"""The collectives of a communicator, of arrays and of objects: argument checks, then the backend's hooks.

A mixin of :class:`~spmd.comms.comm.Comm`, which holds the backend
(``self._backend``), the checks and the call path (``_call``,
``_describing``) these methods go through.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal, Sequence, overload

from spmd.errors import CollectiveError
from spmd.comms.state import meta
from spmd.comms.arrays import check_array, check_op, split_sizes
from spmd.comms.handle import Done
from spmd.comms.hierarchy import takes
from spmd.comms.state.meta import Layout

if TYPE_CHECKING:
    from spmd.comms.handle import Handle
    from spmd.comms.types import ArrayT, Op

__all__ = ["Collectives"]


class Collectives:
    """broadcast, reduce, all_reduce, scatter, gather, all_gather, barrier, and their object forms.

    Long because its one job is: each collective has its typed forms (blocking and async), its
    checks and its call, seven times over.
    """

    @overload
    def broadcast(self, x: ArrayT, root: int = 0, async_op: Literal[False] = False) -> ArrayT: ...
    @overload
    def broadcast(self, x: ArrayT, root: int = 0, *, async_op: Literal[True]) -> Handle[ArrayT]: ...
    @overload
    def broadcast(self, x: ArrayT, root: int = 0, async_op: bool = False) -> ArrayT | Handle[ArrayT]: ...

    def broadcast(self, x: ArrayT, root: int = 0, async_op: bool = False) -> ArrayT | Handle[ArrayT]:
        """Copy root's x into x on every rank, in place; return x.

        A large x on 3 ranks or more goes down a chain of the ranks in pieces,
        each passed on as the next arrives (``SPMD_PIPELINED``; docs/comms.md,
        "Collectives at the link's limit").
        """
        root = self._root(root)
        pipe = self._pipelined
        if pipe is not None and pipe.chains(x):
            return self._call(pipe.broadcast, (self._array(x), root, async_op), "broadcast", x, root, None, async_op)
        if not async_op and not self._mon.active:
            go = self._backend.direct_broadcast(x, root)
            if go is not None:
                self._call(go[0], go[1], "broadcast", x, root)
                return x
        return self._call(self._backend.broadcast, (self._array(x), root, async_op), "broadcast", x, root, None, async_op)

    @overload
    def reduce(self, x: ArrayT, root: int = 0, op: Op = "sum", async_op: Literal[False] = False) -> ArrayT: ...
    @overload
    def reduce(self, x: ArrayT, root: int = 0, op: Op = "sum", *, async_op: Literal[True]) -> Handle[ArrayT]: ...
    @overload
    def reduce(self, x: ArrayT, root: int = 0, op: Op = "sum", async_op: bool = False) -> ArrayT | Handle[ArrayT]: ...

    def reduce(self, x: ArrayT, root: int = 0, op: Op = "sum", async_op: bool = False) -> ArrayT | Handle[ArrayT]:
        """Combine x over ranks into root's x, in place; other ranks' x stay unchanged."""
        root = self._root(root)
        if not async_op and not self._mon.active:
            go = self._backend.direct_reduce(x, root, op)
            if go is not None:
                self._call(go[0], go[1], "reduce", x, root, op)
                return x
        op = check_op(op, self._array(x))
        return self._call(self._backend.reduce, (x, root, op, async_op), "reduce", x, root, op, async_op)

    @overload
    def all_reduce(self, x: ArrayT, op: Op = "sum", async_op: Literal[False] = False,
                   chunk_bytes: int | None = None) -> ArrayT: ...
    @overload
    def all_reduce(self, x: ArrayT, op: Op = "sum", *, async_op: Literal[True],
                   chunk_bytes: int | None = None) -> Handle[ArrayT]: ...
    @overload
    def all_reduce(self, x: Sequence[ArrayT], op: Op = "sum", async_op: Literal[False] = False,
                   chunk_bytes: int | None = None) -> Sequence[ArrayT]: ...
    @overload
    def all_reduce(self, x: Sequence[ArrayT], op: Op = "sum", *, async_op: Literal[True],
                   chunk_bytes: int | None = None) -> Handle[Sequence[ArrayT]]: ...
    @overload
    def all_reduce(self, x: ArrayT | Sequence[ArrayT], op: Op = "sum", async_op: bool = False,
                   chunk_bytes: int | None = None) -> Any: ...

    def all_reduce(self, x: ArrayT | Sequence[ArrayT], op: Op = "sum", async_op: bool = False,
                   chunk_bytes: int | None = None) -> Any:
        """Combine x over ranks into every rank's x, in place; return x.

        x may be a list of arrays: they are reduced as one flat buffer per
        dtype, one call instead of one per array.  With ``chunk_bytes`` a
        large x is reduced in pieces of at most that size (blocking), so
        the backend's scratch memory stays bounded.  On a world across
        hosts, a large array is reduced within each host first, across
        hosts once per host, then handed back within the host
        (``SPMD_HIERARCHY``; docs/comms.md, "Hierarchy across hosts").
        """
        hier = self._hierarchy
        if hier is not None and chunk_bytes is None and not hier.flat and takes(x):
            op = check_op(op, self._array(x))
            return self._call(hier.all_reduce, (x, op, async_op), "all_reduce", x, None, op, async_op)
        if not async_op and chunk_bytes is None and not self._mon.active:
            go = self._backend.direct_all_reduce(x, op)
            if go is not None:
                self._call(go[0], go[1], "all_reduce", x, None, op)
                return x
        if isinstance(x, (list, tuple)):
            from spmd.comms.api.coalesce import all_reduce_many

            return all_reduce_many(self, x, op, async_op)
        op = check_op(op, self._array(x))
        if chunk_bytes is not None and x.ndim and x.shape[0] > 1:
            from spmd.comms.api.coalesce import all_reduce_chunked, nbytes

            if nbytes(x) > chunk_bytes:
                result = all_reduce_chunked(self, x, op, chunk_bytes)
                return Done(result) if async_op else result
        return self._call(self._backend.all_reduce, (x, op, async_op), "all_reduce", x, None, op, async_op)

    @overload
    def scatter(self, chunks: ArrayT | Sequence[ArrayT] | None = None, root: int = 0,
                async_op: Literal[False] = False, *, equal: bool = False, out: ArrayT | None = None) -> ArrayT: ...
    @overload
    def scatter(self, chunks: ArrayT | Sequence[ArrayT] | None = None, root: int = 0, *, async_op: Literal[True],
                equal: bool = False, out: ArrayT | None = None) -> Handle[ArrayT]: ...
    @overload
    def scatter(self, chunks: ArrayT | Sequence[ArrayT] | None = None, root: int = 0, async_op: bool = False, *,
                equal: bool = False, out: ArrayT | None = None) -> ArrayT | Handle[ArrayT]: ...

    def scatter(self, chunks: ArrayT | Sequence[ArrayT] | None = None, root: int = 0, async_op: bool = False, *,
                equal: bool = False, out: ArrayT | None = None) -> ArrayT | Handle[ArrayT]:
        """Send root's i-th chunk to rank i and return this rank's chunk.

        On root, chunks is a list of ``size`` arrays, or one array split
        along dim 0 the way ``numpy.array_split`` does.  Other ranks pass
        None.  Chunk lengths along dim 0 may differ.

        With ``equal=True`` (on every rank) all chunks have one shape and
        root sends no description first: every rank other than root must
        then pass ``out``, the array to receive into.  ``out`` may be
        given in any case; the chunk lands in it and it is returned.
        Without it the chunk is new memory, or that of a large earlier
        result nothing refers to any more (``spmd.comms.state.results``).
        """
        root = self._root(root)
        if equal:
            if out is not None and not async_op and not self._mon.active:
                go = self._backend.direct_scatter(chunks if self.rank == root else None, root, out)
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
        self._describing("scatter", None, root, self._backend.broadcast_ints, header, root)
        if header[0]:
            raise CollectiveError(self._describing("scatter", None, root, self._backend.broadcast_object, error, root))
        layout = Layout(*self._descs.header(header))
        if out is not None:
            self._check_out(out, layout.kind, layout.dtype, (layout.lengths[self.rank],) + layout.trail, "scatter")
        args = (parts, whole, layout, root, out, async_op)
        return self._call(self._backend.scatter, args, "scatter", None, root, None, async_op)

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
        return self._call(self._backend.scatter, args, "scatter", like, root, "equal", async_op)

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
        rows = self._describing(what, x, None, self._backend.allgather_ints, row)
        return self._descs.lengths(x, rows, same, what)

    def _gather_out(self, x, lengths, out, what):
        if out is not None:
            self._array(out, "out")
            self._check_out(out, *self._kind_dtype(x), (sum(lengths),) + tuple(x.shape[1:]), what)
        return out

    @overload
    def gather(self, x: ArrayT, root: int = 0, async_op: Literal[False] = False, *, equal: bool = False,
               out: ArrayT | None = None) -> list[ArrayT] | None: ...
    @overload
    def gather(self, x: ArrayT, root: int = 0, *, async_op: Literal[True], equal: bool = False,
               out: ArrayT | None = None) -> Handle[list[ArrayT] | None]: ...
    @overload
    def gather(self, x: ArrayT, root: int = 0, async_op: bool = False, *, equal: bool = False,
               out: ArrayT | None = None) -> list[ArrayT] | None | Handle[list[ArrayT] | None]: ...

    def gather(self, x: ArrayT, root: int = 0, async_op: bool = False, *, equal: bool = False,
               out: ArrayT | None = None) -> list[ArrayT] | None | Handle[list[ArrayT] | None]:
        """Collect every rank's x on root: a list on root, None elsewhere.

        Lengths along dim 0 may differ between ranks.  With ``equal=True``
        (on every rank) all ranks' x have one shape and no descriptions
        are exchanged first (one collective fewer).  With ``out``, an
        array of every rank's rows one after another, root receives into
        it; the list returned holds views of it.  Without ``out`` the
        result is new memory, or that of a large earlier result nothing
        refers to any more (``spmd.comms.state.results``).
        """
        root = self._root(root)
        if equal and not async_op and not self._mon.active:
            go = self._backend.direct_gather(x, root, out if self.rank == root else None)
            if go is not None:
                return self._call(go[0], go[1], "gather", x, root, "equal")
        lengths = self._lengths(x, "gather", equal)
        out = self._gather_out(x, lengths, out, "gather") if self.rank == root else None
        op = "equal" if equal else None
        return self._call(self._backend.gather, (x, lengths, root, out, async_op), "gather", x, root, op, async_op)

    @overload
    def all_gather(self, x: ArrayT, async_op: Literal[False] = False, *, equal: bool = False,
                   out: ArrayT | None = None) -> list[ArrayT]: ...
    @overload
    def all_gather(self, x: ArrayT, *, async_op: Literal[True], equal: bool = False,
                   out: ArrayT | None = None) -> Handle[list[ArrayT]]: ...
    @overload
    def all_gather(self, x: ArrayT, async_op: bool = False, *, equal: bool = False,
                   out: ArrayT | None = None) -> list[ArrayT] | Handle[list[ArrayT]]: ...

    def all_gather(self, x: ArrayT, async_op: bool = False, *, equal: bool = False,
                   out: ArrayT | None = None) -> list[ArrayT] | Handle[list[ArrayT]]:
        """Collect every rank's x on every rank, as a list in rank order.

        ``equal`` and ``out`` work as for :meth:`gather`.  A large gather
        goes round a ring of the ranks, each sending to the next while it
        receives from the one before (``SPMD_PIPELINED``; docs/comms.md,
        "Collectives at the link's limit").
        """
        pipe = self._pipelined
        if (equal and out is not None and not async_op and not self._mon.active
                and (pipe is None or not pipe.rings(x))):
            go = self._backend.direct_all_gather(x, out)
            if go is not None:
                return self._call(go[0], go[1], "all_gather", x, None, "equal")
        lengths = self._lengths(x, "all_gather", equal)
        out = self._gather_out(x, lengths, out, "all_gather")
        op = "equal" if equal else None
        hook = self._backend.all_gather
        if pipe is not None and pipe.rings(x, sum(lengths)):
            hook = pipe.all_gather
        return self._call(hook, (x, lengths, out, async_op), "all_gather", x, None, op, async_op)

    def barrier(self) -> None:
        """Block until every rank has called barrier."""
        self._call(self._backend.barrier, (), "barrier")

    # -- objects (pickled) ---------------------------------------------------------------

    def broadcast_object(self, obj: Any, root: int = 0) -> Any:
        """Return root's obj on every rank (pickled)."""
        root = self._root(root)
        return self._call(self._backend.broadcast_object, (obj, root), "broadcast_object", None, root)

    def gather_object(self, obj: Any, root: int = 0) -> list[Any] | None:
        """Return the list of every rank's obj on root, None elsewhere."""
        root = self._root(root)
        return self._call(self._backend.gather_object, (obj, root), "gather_object", None, root)

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Return the list of every rank's obj on every rank."""
        return self._call(self._backend.all_gather_object, (obj,), "all_gather_object")

    def scatter_object(self, objs: Sequence[Any] | None = None, root: int = 0) -> Any:
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
        return self._call(self._backend.scatter_object, (objs, root), "scatter_object", None, root)

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
            self._backend.check_device(c, f"scatter chunk {i}")
        parts = list(chunks)
        first = parts[0]
        if (
            meta.dtype_code(first.dtype) < 0
            or not 0 < first.ndim <= meta.MAX_TRAIL + 1
            or any(p.dtype != first.dtype or p.shape[1:] != first.shape[1:] for p in parts)
        ):
            meta.check_rows([meta.encode(p) for p in parts], "scatter")  # raises, naming each
        return parts, None, [p.shape[0] for p in parts]
