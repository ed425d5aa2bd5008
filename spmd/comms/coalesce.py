"""Many small all_reduces as one, and one large all_reduce as bounded pieces.

The guide's two memory and latency fixes (sections 5.2 and 5.3): a list
of tensors is flattened into one buffer per dtype and reduced in one
call, then copied back; a large array is reduced in pieces of at most
``chunk_bytes``, so the backend's scratch space stays that small.
"""

import numpy as np

from .arrays import check_op, is_tensor
from .base import Handle

__all__ = ["all_reduce_many", "all_reduce_chunked", "nbytes"]


def nbytes(x):
    """Return the size of x's data in bytes."""
    return x.nbytes if isinstance(x, np.ndarray) else x.numel() * x.element_size()


def _flatten(group):
    if isinstance(group[0], np.ndarray):
        return np.concatenate([a.reshape(-1) for a in group])
    import torch

    return torch.cat([t if t.dim() == 1 else t.reshape(-1) for t in group])


def _unflatten(flat, group):
    if isinstance(flat, np.ndarray):
        start = 0
        for x in group:
            np.copyto(x, flat[start : start + x.size].reshape(x.shape))
            start += x.size
        return
    import torch

    pieces = flat.split([x.numel() for x in group])
    torch._foreach_copy_(group, [p.view(x.shape) for p, x in zip(pieces, group)])


def all_reduce_many(comm, xs, op, async_op):
    """Reduce every array of xs in place with one call per (kind, dtype, device)."""
    groups = {}
    for i, x in enumerate(xs):
        comm._array(x, f"x[{i}]")
        check_op(op, x)
        key = (is_tensor(x), x.dtype, None if isinstance(x, np.ndarray) else x.device)
        groups.setdefault(key, []).append(x)
    flats = [(_flatten(g), g) for g in groups.values()]
    if not async_op:
        for flat, group in flats:
            comm.all_reduce(flat, op)
            _unflatten(flat, group)
        return xs
    handles = [comm.all_reduce(flat, op, async_op=True) for flat, _ in flats]

    def finish():
        for flat, group in flats:
            _unflatten(flat, group)
        return xs

    return Handle(
        lambda: [h.wait() for h in handles],
        lambda: all(h.is_completed() for h in handles),
        finish,
    )


def all_reduce_chunked(comm, x, op, chunk_bytes):
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
