"""A pipeline run's state as values: what root decided (:class:`Plan`), the run's options, a round's rows.

:class:`Plan` is made by :class:`spmd.pipeline.root.Root` and broadcast,
so it pickles and is the same on every rank; :class:`Options` are the
arguments of :func:`spmd.pipeline.pipeline` that say how rows move;
:class:`Span` is one round: its first row and every rank's share.
docs/pipeline.md says what each mode does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from spmd.pipeline.grid import Grid

__all__ = ["Plan", "Options", "Span"]


@dataclass(frozen=True)
class Plan:
    """What root decided about the input, the output and a journal; the same on every rank."""

    rows: int  # the input's rows
    chunk: int  # rows per round
    shape: tuple  # the input's shape
    dtype: str  # the input's dtype
    in_row_bytes: int
    positional: bool  # the output is a .npy file written at offsets
    resume: bool
    checksum: str  # the kind root proposes (spmd.pipeline.checksum), or the journal's
    forced: bool  # SPMD_CHECKSUM or a journal named it: no falling back to crc32
    why_root: str  # why root reads alone, for the notes, if it does
    shared: Optional[bytes] = None  # the pickled source every rank may open, or None
    start: int = 0  # the first row not done (a journal's)
    rounds_before: int = 0  # rounds a journal says are done
    layout: Optional[tuple] = None  # a resumed output's (dtype, row shape), else None until the first round
    journal: Optional[str] = None  # where the journal is (positional outputs), for the preemption message
    identity: Optional[str] = None  # the shared source's own identity (a format's metadata), checked on every rank
    grid: Optional[Grid] = None  # where the edges of shares and rounds fall (a chunked output's or input's), or any row

    @property
    def row_shape(self) -> tuple:
        """The shape of one input row."""
        return tuple(self.shape[1:])

    def no_rows(self) -> np.ndarray:
        """An empty block of input rows."""
        return np.empty((0,) + self.row_shape, np.dtype(self.dtype))


@dataclass(frozen=True)
class Options:
    """How the rows move: :func:`spmd.pipeline.pipeline`'s read, write, balance, memory, verify, overlap."""

    read: str = "auto"
    write: str = "auto"
    balance: str = "even"
    memory: object = None  # budgets as given: bytes, "512M" or "2G,512M" (spmd.pipeline.balance)
    verify: bool = False
    overlap: bool = True


@dataclass(frozen=True)
class Span:
    """One round: rows start to stop, shares[r] of them for rank r, in rank order."""

    start: int
    shares: tuple

    @classmethod
    def at(cls, start: int, shares) -> Span:
        return cls(start, tuple(shares))

    @property
    def stop(self) -> int:
        return self.start + sum(self.shares)

    @property
    def rows(self) -> int:
        return sum(self.shares)

    def offset(self, rank: int) -> int:
        """Where rank's rows begin, counted from start."""
        return sum(self.shares[:rank])

    def rows_of(self, rank: int) -> tuple:
        """Rank's rows: (first, stop), absolute."""
        first = self.start + self.offset(rank)
        return first, first + self.shares[rank]
