"""Array descriptions as fixed-size integer rows, exchanged in one small collective.

Scatter and the gathers let dim 0 differ between ranks and let receivers
not know the shape in advance, so ranks first exchange what each array
is: kind (numpy or torch), dtype, length of dim 0 and the shape after
it.  A row of ``WIDTH`` int64 costs one tiny collective where a pickled
object would cost two (or a pickle round trip).
"""

import numpy as np

from ..errors import CollectiveError
from .arrays import dtype_name, is_tensor

__all__ = ["WIDTH", "encode", "decode", "check_rows", "scatter_header", "read_header"]

DTYPES = (
    "float32", "float64", "float16", "bfloat16", "complex64", "complex128",
    "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "bool",
)
_CODE = {name: i for i, name in enumerate(DTYPES)}
MAX_TRAIL = 8  # dimensions after dim 0
WIDTH = 4 + MAX_TRAIL  # kind, dtype, length of dim 0 (-1: 0-d), number of trailing dims, trailing dims
_KINDS = ("numpy", "torch")


def encode(x, out=None):
    """Write x's description into out (a row of WIDTH int64), or a new row."""
    row = np.zeros(WIDTH, dtype=np.int64) if out is None else out
    shape = x.shape
    row[0] = 1 if is_tensor(x) else 0
    row[1] = _CODE.get(dtype_name(x), -1)
    row[2] = shape[0] if shape else -1
    trail = shape[1:]
    row[3] = len(trail) if len(trail) <= MAX_TRAIL else -1
    row[4 : 4 + min(len(trail), MAX_TRAIL)] = trail[:MAX_TRAIL]
    return row


def decode(row):
    """Return (kind, dtype, trailing shape, length of dim 0 or None) from a row."""
    ntrail = int(row[3])
    trail = tuple(int(d) for d in row[4 : 4 + max(ntrail, 0)])
    dtype = DTYPES[row[1]] if 0 <= row[1] < len(DTYPES) else "unsupported"
    return _KINDS[int(row[0])], dtype, trail if ntrail >= 0 else "too many dims", (
        int(row[2]) if row[2] >= 0 else None
    )


def check_rows(rows, what):
    """Raise the same error on every rank unless the rows agree; return the lengths."""
    metas = [decode(r) for r in rows]
    first = metas[0]
    if all(m[:3] == first[:3] and m[3] is not None for m in metas) and first[1] != "unsupported" \
            and first[2] != "too many dims":
        return [m[3] for m in metas]
    listing = "; ".join(f"rank {r}: {m[0]} {m[1]} shape {_shape(m)}" for r, m in enumerate(metas))
    raise CollectiveError(
        f"{what}: every rank must pass an array of at least one dimension, at most "
        f"{MAX_TRAIL + 1} dimensions, a dtype among {', '.join(DTYPES)}, with the same dtype "
        f"and the same shape after dim 0 (only dim 0 may differ); got {listing}"
    )


def _shape(meta):
    if not isinstance(meta[2], tuple):
        return meta[2]
    return ("?" if meta[3] is None else meta[3],) + meta[2]


def scatter_header(parts, size):
    """Return root's header row for scatter: flag 0, one description, then every length."""
    header = np.zeros(1 + WIDTH + size, dtype=np.int64)
    encode(parts[0], header[1 : 1 + WIDTH])
    header[1 + WIDTH :] = [p.shape[0] for p in parts]
    return header


def error_header(size):
    """Return a scatter header that says root found an error (its text follows)."""
    header = np.zeros(1 + WIDTH + size, dtype=np.int64)
    header[0] = 1
    return header


def read_header(header):
    """Return (kind, dtype, trail, lengths) from a scatter header."""
    kind, dtype, trail, _ = decode(header[1 : 1 + WIDTH])
    return kind, dtype, trail, [int(n) for n in header[1 + WIDTH :]]
