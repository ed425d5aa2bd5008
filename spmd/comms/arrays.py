"""What a collective may be given: torch tensors and numpy arrays.

Helpers here never import torch themselves; a torch tensor can only
exist if the caller already imported it.
"""

import sys

import numpy as np

from spmd.errors import CollectiveError

__all__ = [
    "OPS",
    "is_tensor",
    "check_array",
    "check_op",
    "dtype_name",
    "is_floating",
    "split_sizes",
    "split_rows",
    "contiguous",
]

OPS = ("sum", "prod", "min", "max", "avg")
_FAST = frozenset(OPS)


def is_tensor(x: object) -> bool:
    """Tell whether x is a torch tensor, without importing torch."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def check_array(x, what="x"):
    """Raise unless x is a torch tensor or a numpy array."""
    if isinstance(x, np.ndarray) or is_tensor(x):
        return x
    raise CollectiveError(
        f"{what} must be a torch.Tensor or a numpy.ndarray, got {type(x).__name__}; "
        "wrap Python values with torch.tensor(...) or numpy.asarray(...), "
        "or use the *_object collectives for arbitrary objects"
    )


def byte_view(a):
    """Return contiguous CPU array or tensor a's memory as a writable flat numpy uint8 array."""
    if isinstance(a, np.ndarray):
        return a.reshape(-1).view(np.uint8)
    import torch

    # as_strided, not reshape: torch calls a tensor with a size-1 dim of any stride contiguous
    return a.detach().as_strided((a.numel(),), (1,)).view(torch.uint8).numpy()


def dtype_name(x):
    """Name x's dtype the same way for torch and numpy ('float32', 'bfloat16')."""
    return str(x.dtype).replace("torch.", "")


def is_floating(x):
    """Tell whether x holds floating-point or complex values."""
    if is_tensor(x):
        return x.is_floating_point() or x.is_complex()
    return np.issubdtype(x.dtype, np.inexact)


def check_op(op, x):
    """Return the canonical name of reduction op for x, or raise."""
    name = op if op in _FAST else str(op).lower()
    if name not in OPS:
        raise CollectiveError(f"unknown reduction op {op!r}; expected one of {', '.join(OPS)}")
    if name == "avg" and not is_floating(x):
        raise CollectiveError(
            f"op='avg' needs a floating-point dtype, got {dtype_name(x)}; "
            "use op='sum' and divide, or cast to a float dtype first"
        )
    return name


def split_sizes(n, parts):
    """Return the lengths numpy.array_split gives when splitting n items into parts."""
    base, extra = divmod(n, parts)
    return [base + 1 if i < extra else base for i in range(parts)]


def split_rows(x, lengths):
    """Cut x along dim 0 into views of the given lengths, in order."""
    out, start = [], 0
    for n in lengths:
        out.append(x[start : start + n])
        start += n
    return out


def contiguous(x):
    """Return a contiguous version of x sharing its memory when possible, and a write-back.

    The write-back (None when x was already contiguous) copies the
    contiguous result into x, for collectives that work in place.
    """
    if isinstance(x, np.ndarray):
        if x.flags.c_contiguous:
            return x, None
        c = np.ascontiguousarray(x)
        return c, lambda: np.copyto(x, c)
    t = x.detach()
    if t.is_contiguous():
        return t, None
    c = t.contiguous()
    return c, lambda: t.copy_(c)
