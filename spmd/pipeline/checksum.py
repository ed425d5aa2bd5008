"""Checksums of array bytes that can be combined: the pipeline's per-block checks and whole-output checksum.

Blocks are checksummed where they are made, on whichever rank, and
root joins them with :func:`combine` into the checksum of the
concatenation (a CRC of A then B follows from the CRCs of A and B and
B's length: zlib's crc32_combine), so no rank ever checksums the whole
output. Two kinds: ``crc32c`` (the ``crc32c`` package, hardware) where
it is installed, else ``crc32`` (zlib); ``SPMD_CHECKSUM`` forces one.
docs/pipeline.md ("Integrity") has their speeds and why other hashes
are not used.
"""

import functools
import os
import zlib

import numpy as np

from spmd.errors import PipelineValueError

__all__ = ["KINDS", "kind", "forced", "has_crc32c", "Checksum", "get", "combine"]

#: The reflected polynomials of the two kinds.
_POLY = {"crc32": 0xEDB88320, "crc32c": 0x82F63B78}
KINDS = tuple(_POLY)


def _crc32c_function():
    try:
        import crc32c
    except ImportError:
        return None
    return crc32c.crc32c


def has_crc32c():
    """Tell whether the crc32c package is installed here."""
    return _crc32c_function() is not None


def forced(environ=os.environ):
    """Tell whether SPMD_CHECKSUM names the kind (rather than spmd choosing the fastest)."""
    return bool(environ.get("SPMD_CHECKSUM", "").strip())


def kind(environ=os.environ):
    """Return the kind to use: SPMD_CHECKSUM if set, else crc32c where installed, else crc32."""
    wanted = environ.get("SPMD_CHECKSUM", "").strip().lower()
    if wanted:
        if wanted not in _POLY:
            raise PipelineValueError(f"SPMD_CHECKSUM={wanted!r}: expected one of {', '.join(KINDS)}")
        if wanted == "crc32c" and _crc32c_function() is None:
            raise PipelineValueError("SPMD_CHECKSUM=crc32c needs the crc32c package: pip install crc32c")
        return wanted
    return "crc32c" if _crc32c_function() is not None else "crc32"


def _bytes(a):
    """a's bytes in C order, as a flat uint8 array (a copy only if a is not contiguous)."""
    a = np.ascontiguousarray(a)
    return a.reshape(-1).view(np.uint8)


class Checksum:
    """One kind of CRC: ``of(array, start)`` and ``combine(first, second, second_bytes)``."""

    def __init__(self, name):
        if name not in _POLY:
            raise PipelineValueError(f"unknown checksum {name!r}; expected one of {', '.join(KINDS)}")
        self.name = name
        self._poly = _POLY[name]
        self._raw = zlib.crc32 if name == "crc32" else _crc32c_function()

    def of(self, a, start=0):
        """Return the CRC of a's bytes in C order, continuing from start (a CRC of what came before)."""
        return self._raw(_bytes(a), start)

    def combine(self, first, second, second_bytes):
        """Return the CRC of A then B from A's CRC, B's CRC and B's length in bytes."""
        return combine(first, second, second_bytes, self._poly)

    def __repr__(self):
        return f"<Checksum {self.name}>"


@functools.lru_cache(maxsize=None)
def get(name=None):
    """Return the Checksum of kind name (default: :func:`kind`)."""
    return Checksum(name or kind())


def _multiply(a, b, poly):
    """a * b modulo the polynomial, both in the reflected bit order CRCs use (a nonzero)."""
    m, p = 1 << 31, 0
    while True:
        if a & m:
            p ^= b
            if not a & (m - 1):
                return p
        m >>= 1
        b = (b >> 1) ^ poly if b & 1 else b >> 1


@functools.lru_cache(maxsize=None)
def _powers(poly):
    """x^(2^k) modulo the polynomial for k = 0..31 (x^1, x^2, x^4, ...)."""
    p, table = 1 << 30, []
    for _ in range(32):
        table.append(p)
        p = _multiply(p, p, poly)
    return tuple(table)


@functools.lru_cache(maxsize=4096)
def _shift(nbytes, poly):
    """x^(8 * nbytes) modulo the polynomial: what appending nbytes does to a CRC."""
    table, p, k, n = _powers(poly), 1 << 31, 3, nbytes
    while n:
        if n & 1:
            p = _multiply(table[k & 31], p, poly)
        n >>= 1
        k += 1
    return p


def combine(first, second, second_bytes, poly=_POLY["crc32"]):
    """Return the CRC of A then B, given CRC(A), CRC(B) and len(B) in bytes (zlib's crc32_combine)."""
    if second_bytes <= 0:
        return first
    return _multiply(_shift(int(second_bytes), poly), first, poly) ^ second
