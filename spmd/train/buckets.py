"""Gradient buckets: which parameters travel together, and how one flat buffer is packed and unpacked.

:func:`plan_buckets` groups tensors by size and dtype, :class:`Bucket` packs
gradients into one flat buffer (compressed on the wire if asked) and writes
the averages back.  What happens to a bucket during a step (hooks, its
all_reduce in flight) is :mod:`spmd.train.overlap`'s; docs/training.md
describes the whole.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch

from spmd.errors import DataParallelError

if TYPE_CHECKING:
    from collections.abc import Callable, Hashable, Iterable, Sequence

    from spmd.comms.comm import Comm

__all__ = ["COMPRESS", "MB", "Bucket", "plan_buckets", "make_buckets", "auto_bucket_mb", "broadcast_tensors"]

#: Accepted values of ``compress`` and the dtype each puts on the wire.
COMPRESS = {None: None, "none": None, "fp16": torch.float16, "bf16": torch.bfloat16}

#: Bytes in a megabyte, as ``bucket_mb`` counts them.
MB = 1 << 20


def default_comm(comm: Comm | None) -> Comm:
    """Return comm, or spmd.comm when it is None."""
    if comm is not None:
        return comm
    from spmd import comm as global_comm

    return global_comm


def plan_buckets(tensors: Sequence[torch.Tensor], bucket_bytes: float,
                 kinds: Sequence[Hashable] | None = None) -> list[list[int]]:
    """Group tensors into buckets of at most bucket_bytes, one dtype (and kind, if given) per bucket.

    Tensors keep their order within each dtype; a tensor larger than
    bucket_bytes gets a bucket of its own, never split.  kinds: one per
    tensor (its wire dtype): tensors of different kinds never share a
    bucket.  Returns lists of indices into tensors, in the order the
    buckets were opened.
    """
    if not bucket_bytes > 0:
        raise DataParallelError(f"bucket_bytes must be positive, got {bucket_bytes!r}")
    buckets, current, used = [], {}, {}
    for i, t in enumerate(tensors):
        key = t.dtype if kinds is None else (t.dtype, kinds[i])
        nbytes = t.numel() * t.element_size()
        b = current.get(key)
        if b is None or (used[key] and used[key] + nbytes > bucket_bytes):
            b = []
            buckets.append(b)
            current[key], used[key] = b, 0
        b.append(i)
        used[key] += nbytes
    return buckets


def auto_bucket_mb(params: Iterable[torch.Tensor], overlap: bool, crowded: bool = False) -> float:
    """Return the default bucket size: 25 MB; with overlap a quarter of the gradients, 1 to 25 MB.

    One all_reduce per 25 MB costs least when nothing overlaps.  With
    overlap, a model smaller than that would travel in one bucket, which
    leaves only at the end of backward: four buckets let three of them go
    while backward runs, and cost few calls (each costs 0.3-1 ms on gloo
    here; with 1-2 MB buckets the calls cost more than they hid).  crowded
    (more ranks on the node than it has CPUs): 25 MB with overlap too.
    Ranks that share cores make every collective a round of waiting for
    descheduled peers, and leave no CPU free to hide communication
    behind: TinyBert at 4 ranks on 2 cores took 8-10 ms more per step in
    5 buckets than in one, overlapped or not (docs/performance.md).
    """
    if not overlap or crowded:
        return 25.0
    total = sum(p.numel() * p.element_size() for p in params) / MB
    return min(25.0, max(1.0, total / 4))


def broadcast_tensors(tensors: Iterable[torch.Tensor], comm: Comm | None = None, root: int = 0,
                      bucket_mb: float = 25.0) -> list[torch.Tensor]:
    """Copy root's values into tensors on every rank, a few flat broadcasts at a time."""
    comm = default_comm(comm)
    tensors = list(tensors)
    if comm.size == 1 or not tensors:
        return tensors
    with torch.no_grad():
        for idx in plan_buckets(tensors, bucket_mb * MB):
            group = [tensors[i] for i in idx]
            flat = torch.cat([t.detach().reshape(-1) for t in group])
            comm.broadcast(flat, root)
            offset = 0
            for t in group:
                n = t.numel()
                t.copy_(flat[offset : offset + n].view_as(t))
                offset += n
    return tensors


#: Where a bucket's averages are read from once its all_reduce is done: a tensor,
#: and what to divide it by on the way into the gradients (None: it holds averages).
Source = tuple[torch.Tensor, int | None]


class Bucket:
    """Parameters whose gradients travel together in one flat buffer."""

    def __init__(self, index: int, params: list[torch.nn.Parameter], compress: str | None) -> None:
        self.index = index
        self.params = params
        self.slices = []
        offset = 0
        for p in params:
            self.slices.append((offset, p.numel()))
            offset += p.numel()
        self.flat = torch.zeros(offset, dtype=params[0].dtype)
        wire = COMPRESS[compress]
        compressible = wire is not None and self.flat.is_floating_point()
        self.wire = torch.zeros(offset, dtype=wire) if compressible else None

    @property
    def nbytes(self) -> int:
        return self.flat.numel() * self.flat.element_size()

    def pack(self, divisor: int) -> torch.Tensor:
        """Copy the gradients in, zeros for missing ones; compress if asked. Returns what to all_reduce."""
        wire = self.wire is not None
        for p, (offset, n) in zip(self.params, self.slices):
            part = self.flat[offset : offset + n]
            g = p.grad
            if g is None:
                part.zero_()
            elif g.is_sparse:
                raise DataParallelError(
                    "DataParallel sends sparse gradients (nn.Embedding(sparse=True)) as rows only: "
                    "pass sparse_rows=True")
            elif wire:  # divide before casting down, so that the sum stays within range
                torch.div(g.reshape(-1), divisor, out=part)
            else:
                part.copy_(g.reshape(-1))
        if not wire:
            return self.flat
        self.wire.copy_(self.flat)
        return self.wire

    def source(self, divisor: int) -> Source:
        """Once the all_reduce is done: say where the averages are read from.

        Nothing moves here: the sums in flat are divided, or the wire's
        averages widened, as they are copied into the gradients (one pass).
        """
        return (self.flat, divisor) if self.wire is None else (self.wire, None)

    def average(self, source: Source) -> Source:
        """Make flat hold the averages themselves (before a late gradient is added to them)."""
        src, div = source
        if div is not None:
            self.flat.div_(div)
        else:
            self.flat.copy_(src)
        return (self.flat, None)

    def unpack(self, source: Source, which: Callable[[torch.nn.Parameter], bool]) -> None:
        """Write the averages from source into the gradients of the parameters p with which(p)."""
        src, div = source
        for p, (offset, n) in zip(self.params, self.slices):
            if not which(p):
                continue
            part = src[offset : offset + n].view_as(p)
            if p.grad is None:
                p.grad = part / div if div is not None else part.to(p.dtype, copy=True)
            elif div is not None:
                torch.div(part, div, out=p.grad)
            else:
                p.grad.copy_(part)


def make_buckets(order: Sequence[torch.nn.Parameter], bucket_mb: float,
                 compress: str | None | Mapping[int, str | None]) -> list[Bucket]:
    """Group the parameters, taken in order, into buckets of about bucket_mb megabytes.

    compress: the wire dtype name of every gradient, or {id(parameter): name}
    (spmd.train.compress.dtype_names); a bucket holds gradients of one wire dtype.
    """
    if not isinstance(compress, Mapping):
        return [Bucket(i, [order[j] for j in idx], compress)
                for i, idx in enumerate(plan_buckets(order, bucket_mb * MB))]
    kinds = [compress.get(id(p)) for p in order]
    return [Bucket(i, [order[j] for j in idx], kinds[idx[0]])
            for i, idx in enumerate(plan_buckets(order, bucket_mb * MB, kinds))]
