"""Collectives of picklable objects, and splitting a communicator.

A mixin of :class:`~spmd.comms.base.Comm`.
"""

from __future__ import annotations

from typing import Any, Self, Sequence

from spmd.errors import CollectiveError

__all__ = ["Objects"]


class Objects:
    """broadcast_object, gather_object, all_gather_object, scatter_object, split."""

    def broadcast_object(self, obj: Any, root: int = 0) -> Any:
        """Return root's obj on every rank (pickled)."""
        root = self._root(root)
        return self._call(self._broadcast_object, (obj, root), "broadcast_object", None, root)

    def gather_object(self, obj: Any, root: int = 0) -> list[Any] | None:
        """Return the list of every rank's obj on root, None elsewhere."""
        root = self._root(root)
        return self._call(self._gather_object, (obj, root), "gather_object", None, root)

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Return the list of every rank's obj on every rank."""
        return self._call(self._all_gather_object, (obj,), "all_gather_object")

    def scatter_object(self, objs: Sequence[Any] | None = None, root: int = 0) -> Any:
        """Return this rank's item of root's list of size objects."""
        root = self._root(root)
        error = None
        if self.rank == root:
            if objs is None or len(objs) != self.size:
                got = "None" if objs is None else len(objs)
                error = f"scatter_object: expecting {self.size} objects (one per rank), got {got}"
        error = self.broadcast_object(error, root)
        if error:
            raise CollectiveError(error)
        objs = list(objs) if self.rank == root else None
        return self._call(self._scatter_object, (objs, root), "scatter_object", None, root)

    # -- sub-communicators -----------------------------------------------------

    def split(self, color: int | None = 0, key: int | None = None, *,
              ranks: Sequence[int] | None = None) -> Self | None:
        """Split into sub-communicators, MPI_Comm_split style.

        Ranks passing the same color form one communicator, ordered by
        key then by rank; color None gets None back.  With ``ranks=[...]``
        the listed ranks (in that order) form one and the rest get None.
        Every rank must call split.
        """
        if ranks is not None:
            ranks = list(ranks)
            bad = [r for r in ranks if not isinstance(r, int) or not 0 <= r < self.size]
            if bad or len(set(ranks)) != len(ranks):
                raise CollectiveError(
                    f"split: ranks must be distinct integers in 0..{self.size - 1}, got {ranks}"
                )
            color = 0 if self.rank in ranks else None
            key = ranks.index(self.rank) if self.rank in ranks else 0
        if color is not None and (not isinstance(color, int) or color < 0):
            raise CollectiveError(f"split: color must be a non-negative int or None, got {color!r}")
        key = self.rank if key is None else key
        self._mon.dirty = True  # a group now hangs off this communicator
        return self._call(self._split_comm, (color, key), "split")

    def free(self) -> None:
        """Release a communicator that split made, as MPI_Comm_free: its ranks call it together.

        Its process group (or MPI communicator) and buffers go at once, not
        at finalize; it cannot be used after.  The world ends with
        spmd.finalize().
        """
        if self._mon.family[0] is self._mon:  # the world's monitor heads the family of its splits
            raise CollectiveError("free: the world communicator ends with spmd.finalize(), not free()")
        self._free()
