"""Many small all_reduces as one, and one large all_reduce as bounded pieces.

The guide's two memory and latency fixes (sections 5.2 and 5.3): a list
of tensors is flattened into one buffer per dtype and reduced in one
call, then copied back; a large array is reduced in pieces of at most
``chunk_bytes``, so the backend's scratch space stays that small.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from spmd.comms.arrays import check_op
from spmd.comms.handle import Handle

if TYPE_CHECKING:
    from spmd.comms.types import Array, ArrayT, Op

__all__ = ["all_reduce_many", "all_reduce_chunked", "nbytes"]


def nbytes(x: Array) -> int:
    """Return the size of x's data in bytes."""
    return x.nbytes if isinstance(x, np.ndarray) else x.numel() * x.element_size()


def _views(buf, shapes):
    """Return views of flat buffer buf, one per shape, in order."""
    out, start = [], 0
    for shape in shapes:
        n = 1
        for d in shape:
            n *= d
        out.append(buf[start : start + n].reshape(shape))
        start += n
    return out


def _kept(comm, key, make, nbytes):
    """Return make() (a buffer of nbytes), kept in the communicator's caches under key."""
    flat = comm._caches.flat
    hit = flat.get(key)
    if hit is None:
        hit = make()
        flat.put(key, hit, nbytes)
    return hit


def _new_flat(first, numel):
    """Return an empty 1-d buffer of numel items of first's kind and dtype."""
    return np.empty(numel, first.dtype) if isinstance(first, np.ndarray) else first.new_empty(numel)


def _flat_views(comm, group, keep):
    """Return (a flat buffer holding the group, views of it shaped like each array).

    With keep (blocking calls), the buffer and its views are kept on the
    communicator per (dtype, device, shapes) and reused, so a training loop
    neither faults in fresh pages nor builds hundreds of views each step.
    """
    first = group[0]
    shapes = tuple(x.shape for x in group)
    numel = sum(x.size if isinstance(x, np.ndarray) else x.numel() for x in group)

    def make():
        buf = _new_flat(first, numel)
        return buf, _views(buf, shapes)

    if not keep:
        return make()
    key = (type(first), first.dtype, getattr(first, "device", None), shapes)
    return _kept(comm, key, make, numel * _itemsize(first))


def _copy(dst, src):
    """dst[i][...] = src[i] for each i, in one call for tensors."""
    if isinstance(dst[0], np.ndarray):
        for d, s in zip(dst, src):
            np.copyto(d, s)
        return
    import torch

    with torch.no_grad():
        torch._foreach_copy_(dst, src)


def _flat(comm, first, nbytes):
    """Return a kept flat buffer of first's kind and dtype holding nbytes."""
    itemsize = _itemsize(first)
    return _kept(comm, (type(first), first.dtype, nbytes), lambda: _new_flat(first, nbytes // itemsize), nbytes)


def _itemsize(x):
    return x.itemsize if isinstance(x, np.ndarray) else x.element_size()


def all_reduce_many(comm: Any, xs: Sequence[ArrayT], op: Op, async_op: bool) -> Any:
    """Reduce every array of xs in place with one call per (kind, dtype, device)."""
    if not async_op and xs:
        # One kind and dtype on the CPU (the usual list of gradients): where the
        # backend packs in one call, one pass over the list is all the Python.
        mover = comm._backend.mover(xs)
        if mover is not None:
            comm._array(xs[0], "x[0]")
            check_op(op, xs[0])
            flat = _flat(comm, xs[0], mover.nbytes)
            mover.pack(flat)
            comm.all_reduce(flat, op)
            mover.unpack(flat)
            return xs
    groups, firsts = {}, {}
    torch = sys.modules.get("torch")
    tensor = torch.Tensor if torch is not None else np.ndarray
    for i, x in enumerate(xs):
        kind = type(x)
        if kind is np.ndarray or (kind is tensor and x.is_cpu):
            key = (x.dtype, None)  # CPU: checked once per group below
        else:
            comm._array(x, f"x[{i}]")
            key = (x.dtype, x.device)
        group = groups.get(key)
        if group is None:
            group = groups[key] = []
            firsts[key] = i
        group.append(x)
    for key, group in groups.items():
        comm._array(group[0], f"x[{firsts[key]}]")  # CPU data on a GPU backend, ...
        check_op(op, group[0])  # the op must suit each dtype
    if not async_op:
        for group in groups.values():
            flat, views = _flat_views(comm, group, keep=True)
            _copy(views, group)
            comm.all_reduce(flat, op)
            _copy(group, views)
        return xs
    flats = []  # fresh buffers: asynchronous calls may overlap
    for group in groups.values():
        flat, views = _flat_views(comm, group, keep=False)
        _copy(views, group)
        flats.append((flat, views, group))
    handles = [comm.all_reduce(flat, op, async_op=True) for flat, _, _ in flats]

    def finish():
        for _, views, group in flats:
            _copy(group, views)
        return xs

    return Handle(
        lambda: [h.wait() for h in handles],
        lambda: all(h.is_completed() for h in handles),
        finish,
    )


def all_reduce_chunked(comm: Any, x: ArrayT, op: Op, chunk_bytes: int) -> ArrayT:
    """Reduce x in place in pieces of at most chunk_bytes (at least one row each)."""
    contiguous = x.flags.c_contiguous if isinstance(x, np.ndarray) else x.is_contiguous()
    if contiguous:
        flat = x.reshape(-1)
        step = max(1, chunk_bytes // flat.itemsize if isinstance(flat, np.ndarray)
                   else chunk_bytes // flat.element_size())
        pieces = (flat[i : i + step] for i in range(0, flat.shape[0], step))
    else:  # rows are views; each is made contiguous (a bounded copy) by the backend
        row = max(1, nbytes(x) // max(1, x.shape[0]))
        step = max(1, chunk_bytes // row)
        pieces = (x[i : i + step] for i in range(0, x.shape[0], step))
    for piece in pieces:
        comm.all_reduce(piece, op)
    return x
