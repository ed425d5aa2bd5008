"""Every piece of performance state a communicator keeps: one owner, a bound, an end.

Each communicator owns one :class:`Caches` (``comm._caches``): description
rows (``descs``), the results pool (``results``), the coalesced
all_reduce's flat buffers (``flat``), the mpi packer's datatypes
(``layouts``) and the mpi direct path's plans (``plans``), each bounded.
``clear()`` lets everything go, at finalize; ``switch(name, False)`` turns
one off.  The table of what each holds and its bound: docs/comms.md,
"The caches".
"""

from __future__ import annotations

import weakref

from spmd.errors import SettingsError
from spmd.comms.state.meta import Descriptions
from spmd.comms.state.results import Results

__all__ = ["Caches", "Kept", "NAMES", "FLAT_COUNT", "LAYOUT_COUNT", "PLAN_COUNT"]

NAMES = ("descs", "results", "flat", "layouts", "plans")
#: Coalesced lists whose flat buffers are kept at a time (a training loop has one or two).
FLAT_COUNT = 8
#: Committed datatypes kept at a time.
LAYOUT_COUNT = 16
#: Direct-path plans of small torch calls kept at a time.
PLAN_COUNT = 16


class Kept:
    """A small table of reusable things, bounded in count and bytes; full, it starts over.

    ``release(value)`` is called on everything let go (the mpi layouts free
    their datatypes there).
    """

    def __init__(self, count, nbytes=None, release=None):
        self.count = count
        self.limit = nbytes  # None: count only; a callable: read when storing
        self._release = release
        self.table = {}  # read it directly where a method call costs too much
        self.nbytes = 0

    def get(self, key):
        return self.table.get(key)

    def put(self, key, value, nbytes=0):
        """Keep value under key when it fits the bounds; tell whether it was kept."""
        limit = self.limit() if callable(self.limit) else self.limit
        if self.count <= 0 or (limit is not None and nbytes > limit):
            return False
        if len(self.table) >= self.count or (limit is not None and self.nbytes + nbytes > limit):
            self.clear()
        self.table[key] = value
        self.nbytes += nbytes
        return True

    def clear(self):
        if self._release is not None:
            for value in self.table.values():
                self._release(value)
        self.table.clear()
        self.nbytes = 0

    def __len__(self):
        return len(self.table)


class Caches:
    """The performance state of one communicator (see the module docstring)."""

    def __init__(self, size: int, results: Results | None = None) -> None:
        self.size = size
        self.descs = Descriptions(size)
        self._owns_results = results is None
        self.results = Results() if results is None else results
        self.flat = Kept(FLAT_COUNT, lambda: self.results.limit)
        self.layouts = Kept(LAYOUT_COUNT, release=_free_layout)
        self.plans = Kept(PLAN_COUNT)
        self._results_limit = None  # the pool's limit while switched off
        self._children = weakref.WeakSet()

    def child(self, size):
        """Return the caches of a communicator split from this one (sharing the results pool)."""
        sub = Caches(size, self.results)
        for name in NAMES:
            if not self.on(name):
                sub.switch(name, False)
        self._children.add(sub)
        return sub

    def on(self, name):
        """Tell whether cache name is on."""
        return {
            "descs": self.descs.on,
            "results": self.results.limit != 0,
            "flat": self.flat.count > 0,
            "layouts": self.layouts.count > 0,
            "plans": self.plans.count > 0,
        }[name]

    def switch(self, name, on):
        """Turn cache name on or off (off: everything it held is let go, nothing is kept)."""
        if name not in NAMES:
            raise SettingsError(f"unknown cache {name!r}; expected one of {', '.join(NAMES)}")
        if name == "descs":
            self.descs.switch(on)
        elif name == "results":
            self.results.clear()
            if not on and self.results.limit:
                self._results_limit = self.results.limit  # restored when switched on again
            self.results.configure_limit(self._results_limit if on else 0)
        elif name == "flat":
            self.flat.clear()
            self.flat.count = FLAT_COUNT if on else 0
        elif name == "layouts":
            self.layouts.clear()
            self.layouts.count = LAYOUT_COUNT if on else 0
        else:
            self.plans.clear()
            self.plans.count = PLAN_COUNT if on else 0

    @property
    def nbytes(self):
        """Bytes of buffers held (results pool, flat buffers)."""
        return self.results.nbytes + self.flat.nbytes

    def clear(self):
        """Let everything go, here and in every communicator split from this one."""
        for sub in list(self._children):
            sub.clear()
        self.descs.clear()
        if self._owns_results:
            self.results.clear()
        self.flat.clear()
        self.layouts.clear()
        self.plans.clear()


def _free_layout(layout):
    """Free a kept mpi layout's committed datatype (False marks arrays that overlap)."""
    if layout is False:
        return
    import sys

    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and not mpi.Is_finalized():
        layout[0].Free()
