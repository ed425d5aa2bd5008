"""all_to_all, reduce_scatter, scan and exscan: the collectives beyond the guide's six.

A mixin of :class:`~spmd.comms.comm.Comm`, whose backend has the hooks
(``all_to_all``, ``reduce_scatter``, ``scan``) and which holds the call path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal, Sequence, overload

import numpy as np

from spmd.errors import CollectiveError
from spmd.comms.state import meta
from spmd.comms.arrays import check_op, dtype_name, is_tensor, split_sizes
from spmd.comms.handle import Handle
from spmd.comms.state.meta import Layout

if TYPE_CHECKING:
    from spmd.comms.types import ArrayT, Op

__all__ = ["Exchanges", "identity"]

#: Ops scan and exscan take (MPI's, and what a prefix over ranks means).
SCAN_OPS = ("sum", "prod", "min", "max")


def identity(x, op):
    """Fill x, in place, with op's identity for x's dtype (exscan's result on rank 0); return x."""
    if op == "sum":
        value = 0
    elif op == "prod":
        value = 1
    else:
        dtype = x.dtype
        if is_tensor(x):
            import torch

            if dtype == torch.bool:
                value = op == "min"
            elif dtype.is_floating_point:
                value = float("inf") if op == "min" else float("-inf")
            else:
                info = torch.iinfo(dtype)
                value = info.max if op == "min" else info.min
        elif dtype == np.bool_:
            value = op == "min"
        elif np.issubdtype(dtype, np.floating):
            value = np.inf if op == "min" else -np.inf
        else:
            info = np.iinfo(dtype)
            value = info.max if op == "min" else info.min
    if is_tensor(x):
        x.fill_(value)
    else:
        x[...] = value
    return x


class Exchanges:
    """all_to_all, reduce_scatter, scan, exscan."""

    @overload
    def all_to_all(self, chunks: ArrayT | Sequence[ArrayT], *, equal: bool = False, out: ArrayT | None = None,
                   async_op: Literal[False] = False) -> list[ArrayT]: ...
    @overload
    def all_to_all(self, chunks: ArrayT | Sequence[ArrayT], *, equal: bool = False, out: ArrayT | None = None,
                   async_op: Literal[True]) -> Handle[list[ArrayT]]: ...
    @overload
    def all_to_all(self, chunks: ArrayT | Sequence[ArrayT], *, equal: bool = False, out: ArrayT | None = None,
                   async_op: bool = False) -> list[ArrayT] | Handle[list[ArrayT]]: ...

    def all_to_all(self, chunks: ArrayT | Sequence[ArrayT], *, equal: bool = False, out: ArrayT | None = None,
                   async_op: bool = False) -> list[ArrayT] | Handle[list[ArrayT]]:
        """Send chunk j to rank j and return the list of chunks received, in rank order.

        chunks is a list of ``size`` arrays (lengths along dim 0 may
        differ, like MPI's alltoallv; one dtype and shape after dim 0 on
        every rank) or one array, split along dim 0 the way
        ``numpy.array_split`` does.  Ranks first exchange how many rows
        each sends each; with ``equal=True`` (on every rank) all chunks
        everywhere have one shape and nothing is exchanged first.  With
        ``out``, an array of the received rows one after another, chunks
        land in it and the list holds views of it.
        """
        parts, whole, sent = self._chunks(chunks, "all_to_all")
        first = whole if parts is None else parts[0]
        kind, dtype = self._kind_dtype(first)
        trail = tuple(first.shape[1:])
        if equal:
            if sent.count(sent[0]) != self.size:
                raise CollectiveError(f"all_to_all(equal=True): chunk lengths differ ({sent}); pass equal=False")
            received = list(sent)
        else:
            row = np.concatenate([meta.encode(first[:0] if parts is None else first), np.asarray(sent, np.int64)])
            rows = self._describing("all_to_all", first, None, self._backend.allgather_ints, row)
            meta.check_rows(rows[:, : meta.WIDTH], "all_to_all")  # one dtype and trailing shape everywhere
            received = rows[:, meta.WIDTH + self.rank].tolist()
        if out is not None:
            self._array(out, "out")
            self._check_out(out, kind, dtype, (sum(received),) + trail, "all_to_all")
        layout = Layout(kind, dtype, trail, received)
        args = (parts, whole, sent, layout, out, async_op)
        return self._call(self._backend.all_to_all, args, "all_to_all", first, None, "equal" if equal else None, async_op)

    def _chunks(self, chunks, what):
        """Return (list of size arrays or None, whole array or None, each chunk's length), or raise."""
        if isinstance(chunks, (list, tuple)):
            if len(chunks) != self.size:
                raise CollectiveError(f"{what}: expecting {self.size} chunks (one per rank), got {len(chunks)}")
            parts = list(chunks)
            for i, c in enumerate(parts):
                self._array(c, f"{what} chunk {i}")
            first = parts[0]
            if first.ndim == 0 or any(p.dtype != first.dtype or p.shape[1:] != first.shape[1:] for p in parts):
                listing = "; ".join(f"chunk {i}: {dtype_name(p)} {tuple(p.shape)}" for i, p in enumerate(parts))
                raise CollectiveError(
                    f"{what}: chunks must have at least one dimension, one dtype and one shape after dim 0; "
                    f"got {listing}"
                )
            return parts, None, [p.shape[0] for p in parts]
        self._array(chunks, f"{what} chunks")
        if chunks.ndim == 0:
            raise CollectiveError(f"{what}: cannot split a 0-d array; pass a list of chunks")
        return None, chunks, split_sizes(chunks.shape[0], self.size)

    @overload
    def reduce_scatter(self, x: ArrayT, op: Op = "sum", async_op: Literal[False] = False) -> ArrayT: ...
    @overload
    def reduce_scatter(self, x: ArrayT, op: Op = "sum", *, async_op: Literal[True]) -> Handle[ArrayT]: ...
    @overload
    def reduce_scatter(self, x: ArrayT, op: Op = "sum", async_op: bool = False) -> ArrayT | Handle[ArrayT]: ...

    def reduce_scatter(self, x: ArrayT, op: Op = "sum", async_op: bool = False) -> ArrayT | Handle[ArrayT]:
        """Reduce x over ranks and return this rank's block of the result.

        x is split along dim 0 the way ``numpy.array_split`` does; rank i
        gets block i (a new array of x's kind and dtype).  Every rank
        passes x of one shape.
        """
        op = check_op(op, self._array(x))
        if x.ndim == 0:
            raise CollectiveError("reduce_scatter: cannot split a 0-d array into blocks; pass at least one dimension")
        lengths = split_sizes(x.shape[0], self.size)
        return self._call(self._backend.reduce_scatter, (x, lengths, op, async_op), "reduce_scatter", x, None, op, async_op)

    @overload
    def scan(self, x: ArrayT, op: Op = "sum", async_op: Literal[False] = False) -> ArrayT: ...
    @overload
    def scan(self, x: ArrayT, op: Op = "sum", *, async_op: Literal[True]) -> Handle[ArrayT]: ...
    @overload
    def scan(self, x: ArrayT, op: Op = "sum", async_op: bool = False) -> ArrayT | Handle[ArrayT]: ...

    def scan(self, x: ArrayT, op: Op = "sum", async_op: bool = False) -> ArrayT | Handle[ArrayT]:
        """Replace x, in place, by the reduction of x over ranks 0 to this rank (inclusive prefix); return x."""
        return self._prefix(x, op, False, async_op, "scan")

    @overload
    def exscan(self, x: ArrayT, op: Op = "sum", async_op: Literal[False] = False) -> ArrayT: ...
    @overload
    def exscan(self, x: ArrayT, op: Op = "sum", *, async_op: Literal[True]) -> Handle[ArrayT]: ...
    @overload
    def exscan(self, x: ArrayT, op: Op = "sum", async_op: bool = False) -> ArrayT | Handle[ArrayT]: ...

    def exscan(self, x: ArrayT, op: Op = "sum", async_op: bool = False) -> ArrayT | Handle[ArrayT]:
        """Replace x, in place, by the reduction of x over ranks 0 to this rank - 1; return x.

        Rank 0 gets the op's identity: 0 for sum, 1 for prod, the dtype's
        largest value (inf for floats, True for bool) for min, its
        smallest for max.
        """
        return self._prefix(x, op, True, async_op, "exscan")

    def _prefix(self, x, op, exclusive, async_op, name):
        op = check_op(op, self._array(x))
        if op not in SCAN_OPS:
            raise CollectiveError(f"{name}: op {op!r} has no prefix form; use one of {', '.join(SCAN_OPS)}")
        result = self._call(self._backend.scan, (x, exclusive, op, async_op), name, x, None, op, async_op)
        if exclusive and self.rank == 0:
            if async_op:
                inner = result
                return Handle(inner.wait, inner.is_completed, lambda: identity(inner.wait(), op))
            else:
                identity(x, op)
        return result
