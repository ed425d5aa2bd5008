"""Array descriptions as fixed-size integer rows, exchanged in one small collective.

Scatter and the gathers let dim 0 differ between ranks and let receivers
not know the shape in advance, so ranks first exchange what each array
is: kind (numpy or torch), dtype, length of dim 0 and the shape after
it.  A row of ``WIDTH`` int64 costs one tiny collective where a pickled
object would cost two (or a pickle round trip).
"""

from typing import NamedTuple

import numpy as np

from spmd.errors import CollectiveError
from spmd.comms.arrays import is_tensor

__all__ = ["WIDTH", "encode", "decode", "check_rows", "scatter_header", "Descriptions", "Layout"]

DTYPES = (
    "float32", "float64", "float16", "bfloat16", "complex64", "complex128",
    "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "bool",
)
_CODE = {name: i for i, name in enumerate(DTYPES)}
MAX_TRAIL = 8  # dimensions after dim 0
WIDTH = 4 + MAX_TRAIL  # kind, dtype, length of dim 0 (-1: 0-d), number of trailing dims, trailing dims
_KINDS = ("numpy", "torch")


_BY_DTYPE = {}  # dtype object -> code; str() of a numpy dtype costs microseconds


def dtype_code(dtype):
    """Return the code of a numpy or torch dtype, or -1 when not supported."""
    code = _BY_DTYPE.get(dtype)
    if code is None:
        code = _BY_DTYPE[dtype] = _CODE.get(str(dtype).replace("torch.", ""), -1)
    return code


def encode(x):
    """Return x's description: a row of WIDTH int64."""
    shape = x.shape
    trail = shape[1:]
    values = [1 if is_tensor(x) else 0, dtype_code(x.dtype), shape[0] if shape else -1,
              len(trail) if len(trail) <= MAX_TRAIL else -1, *trail[:MAX_TRAIL]]
    values += [0] * (WIDTH - len(values))
    return np.array(values, dtype=np.int64)


def decode(row):
    """Return (kind, dtype, trailing shape, length of dim 0 or None) from a row."""
    row = row.tolist() if hasattr(row, "tolist") else row
    ntrail = row[3]
    trail = tuple(row[4 : 4 + ntrail]) if ntrail >= 0 else "too many dims"
    dtype = DTYPES[row[1]] if 0 <= row[1] < len(DTYPES) else "unsupported"
    return _KINDS[row[0]], dtype, trail, (row[2] if row[2] >= 0 else None)


def check_rows(rows, what):
    """Raise the same error on every rank unless the rows agree; return the lengths."""
    rows = rows.tolist() if hasattr(rows, "tolist") else [r.tolist() for r in rows]
    first = rows[0]
    head, tail = first[:2], first[3:]
    if first[1] >= 0 and first[3] >= 0 and all(
        r[:2] == head and r[3:] == tail and r[2] >= 0 for r in rows
    ):
        return [r[2] for r in rows]
    metas = [decode(r) for r in rows]
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


def scatter_header(first, lengths):
    """Return root's header row for scatter: flag 0, first chunk's description, then every length."""
    return np.array([0, *encode(first).tolist(), *lengths], dtype=np.int64)


def error_header(size):
    """Return a scatter header that says root found an error (its text follows)."""
    header = np.zeros(1 + WIDTH + size, dtype=np.int64)
    header[0] = 1
    return header


def _valid(row):
    """Tell whether a row describes an array scatter and the gathers can move."""
    return row[1] >= 0 and row[2] >= 0 and row[3] >= 0


class Descriptions:
    """One communicator's description rows, cached per (type, dtype, shape).

    Encoding a row and checking every rank's rows costs tens of
    microseconds of Python; most programs gather the same shapes over
    and over.  ``row(x)`` returns x's row and the bytes that ``size``
    copies of it make, so ``lengths`` can tell with one comparison that
    every rank passed the same shape.
    """

    LIMIT = 256  # distinct shapes kept; the cache starts over beyond

    def __init__(self, size):
        self.size = size
        self.on = True  # off: nothing is kept (for measuring what keeping saves)
        self._rows = {}
        self._headers = {}
        self._sent = {}  # root's scatter headers
        self._checked = {}  # gathered rows (bytes) that passed check_rows -> lengths
        self._messages = {}  # point-to-point header rows (bytes) -> (kind, dtype, shape)
        #: (type, dtype, shape[, device]) -> point to point's plan of a message (spmd.comms.p2p.methods)
        self.plans = {}

    def row(self, x):
        """Return (x's row, the bytes of every rank sending the same valid row, or None)."""
        key = (type(x), x.dtype, x.shape)
        hit = self._rows.get(key)
        if hit is None:
            row = encode(x)
            hit = self._keep(self._rows, key, (row, row.tobytes() * self.size if _valid(row.tolist()) else None))
        return hit

    def lengths(self, x, rows, same, what):
        """Return every rank's dim-0 length from the gathered rows, or raise everywhere."""
        seen = rows.tobytes()
        if same is not None and seen == same:
            return [x.shape[0]] * self.size
        hit = self._checked.get(seen)  # rows that differ in dim 0 only, checked before
        if hit is None:
            hit = self._keep(self._checked, seen, check_rows(rows, what))  # raises unless they agree
        return list(hit)

    def scatter_header(self, first, lengths):
        """Return root's scatter header for first chunk and lengths (kept: Bcast only reads it)."""
        key = (type(first), first.dtype, first.shape, *lengths)
        hit = self._sent.get(key)
        if hit is None:
            hit = self._keep(self._sent, key, scatter_header(first, lengths))
        return hit

    def header(self, header):
        """Return (kind, dtype, trail, lengths) from a scatter header, decoding each description once."""
        key = header[1 : 1 + WIDTH].tobytes()
        hit = self._headers.get(key)
        if hit is None:
            kind, dtype, trail, _ = decode(header[1 : 1 + WIDTH])
            hit = self._keep(self._headers, key, (kind, dtype, trail))
        return hit + (header[1 + WIDTH :].tolist(),)

    def message(self, header):
        """Return (kind, dtype, shape) of a point-to-point message's header row, decoding each once."""
        key = header.tobytes()
        hit = self._messages.get(key)
        if hit is None:
            kind, dtype, trail, n = decode(header)
            hit = self._keep(self._messages, key, (kind, dtype, tuple(trail) if n is None else (n,) + tuple(trail)))
        return hit

    def keep_plan(self, key, plan):
        """Keep a point-to-point message's plan (on a miss only) and return it."""
        return self._keep(self.plans, key, plan)

    def switch(self, on):
        """Turn keeping on or off (off: what was kept is let go)."""
        self.on = on
        self.clear()

    def clear(self):
        """Let every kept description go."""
        for cache in (self._rows, self._headers, self._sent, self._checked, self._messages, self.plans):
            cache.clear()

    def _keep(self, cache, key, value):
        """Store value under key (on a miss only) and return it; a full cache starts over."""
        if not self.on:
            return value
        if len(cache) >= self.LIMIT:
            cache.clear()
        cache[key] = value
        return value


class Layout(NamedTuple):
    """What every rank receives from scatter: kind, dtype, shape after dim 0, each rank's length."""

    kind: str  # "numpy" or "torch"
    dtype: str  # dtype_name(): "float32", "bfloat16", ...
    trail: tuple
    lengths: list
