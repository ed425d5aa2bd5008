"""Where the edges between ranks' shares and between rounds may fall: any row, or a format's chunk edges.

A Zarr output is written by the ranks that own its chunks, so no chunk
may be cut by two ranks' rows or by two rounds; a chunked input (Zarr,
HDF5, Parquet row groups) is read faster when none is decoded by two
ranks.  :class:`Grid` holds those edges (a step, or a list) and
:meth:`Grid.align` moves a round's planned shares onto them.  Moving an
edge changes a share by less than one chunk; the output does not
depend on the shares, only on the rows (docs/pipeline.md, "Balance").
A round holds at least one chunk per rank.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Optional, Sequence

__all__ = ["Grid", "ANY_ROW"]


@dataclass(frozen=True)
class Grid:
    """Edges every step rows, or at the rows listed in edges (ascending); both empty: any row."""

    step: int = 1
    edges: tuple = ()
    why: str = ""  # what the edges are, for the notes: "the output's Zarr chunks of 65536 rows"

    @classmethod
    def of(cls, step: Optional[int] = None, edges: Optional[Sequence[int]] = None, why: str = "") -> Grid:
        if edges is not None:
            return cls(1, tuple(sorted({int(e) for e in edges})), why)
        return cls(max(int(step or 1), 1), (), why)

    @property
    def free(self) -> bool:
        """Every row is an edge: nothing to align."""
        return self.step == 1 and not self.edges

    def _below(self, x: int) -> Optional[int]:
        if self.edges:
            i = bisect.bisect_right(self.edges, x) - 1
            return self.edges[i] if i >= 0 else None
        return x // self.step * self.step

    def _above(self, x: int) -> Optional[int]:
        if self.edges:
            i = bisect.bisect_left(self.edges, x)
            return self.edges[i] if i < len(self.edges) else None
        return -(-x // self.step) * self.step

    def round_rows(self, chunk: int, size: int) -> int:
        """A round's rows: chunk, but at least one chunk of the grid per rank (a round of fewer chunks than
        ranks would leave some ranks nothing to do)."""
        return max(chunk, self.step * size) if not self.edges else chunk

    def nearest(self, x: int, lo: int, hi: int) -> int:
        """The edge nearest x within lo to hi (x itself where none is; the lower on a tie)."""
        choices = [e for e in (self._below(x), self._above(x)) if e is not None and lo <= e <= hi]
        return min(choices, key=lambda e: (abs(e - x), e)) if choices else x

    def align(self, shares: Sequence[int], start: int, end: int) -> list[int]:
        """shares (rows per rank from start) moved so that the round's end and every edge between ranks
        fall on the grid; end is the data's last row (an edge too). Returns the new shares."""
        stop = start + sum(shares)
        if self.free or stop <= start:
            return list(shares)
        if stop < end:  # the round ends at the edge below, or the one above when that would leave it empty
            down, up = self._below(stop), self._above(stop)
            if down is not None and down > start:
                stop = down
            elif up is not None:
                stop = min(up, end)
        cuts, planned = [start], start
        for n in list(shares)[:-1]:
            planned += n
            cuts.append(self.nearest(min(planned, stop), cuts[-1], stop))
        cuts.append(stop)
        return [b - a for a, b in zip(cuts, cuts[1:])]


#: Any row may be an edge.
ANY_ROW = Grid()
