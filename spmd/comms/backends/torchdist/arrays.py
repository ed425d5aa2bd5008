"""Arrays as torch.distributed takes them: tensors sharing memory, complex as real views, op codes."""

import warnings

import numpy as np
import torch
import torch.distributed as dist

from spmd.comms.arrays import contiguous

__all__ = ["OPS", "tensor", "as_kind", "real_view", "all_gather_single", "reduce_scatter_single"]

OPS = {
    "sum": dist.ReduceOp.SUM,
    "prod": dist.ReduceOp.PRODUCT,
    "min": dist.ReduceOp.MIN,
    "max": dist.ReduceOp.MAX,
    "avg": dist.ReduceOp.SUM,
}

# Renamed in torch 2.13; the old name warns there.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def tensor(x):
    """Return a contiguous tensor sharing x's memory where possible, and a write-back."""
    c, back = contiguous(x)
    if not isinstance(c, np.ndarray):
        return c, back
    if not c.flags.writeable:  # a read-only array (a send's payload): torch warns, though nobody writes
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            return torch.from_numpy(c), back
    return torch.from_numpy(c), back


def as_kind(t, kind):
    """Return tensor t as the kind the caller gave: numpy (sharing memory) or torch."""
    return t.numpy() if kind == "numpy" else t


def real_view(t):
    """Return t as torch.distributed's scatter and gather take it: complex as its real view (same memory)."""
    return torch.view_as_real(t) if t.is_complex() else t
# Renamed in torch 2.13 too.
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
