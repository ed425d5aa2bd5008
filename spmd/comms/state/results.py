"""Arrays that scatter and the gathers return, reused once the program has dropped them.

A fresh result costs page faults as it is first written, so the pool
keeps the buffers of large results and hands one back once nothing but
the pool refers to it (its reference count; a tensor's storage use count).
A buffer changed in place before it was dropped is let go.  Bounded by
``PER_SHAPE`` and ``SPMD_KEEP_RESULTS`` bytes; ``clear()`` (at finalize)
lets them go.  The rules and their limits: docs/comms.md, "The results pool".
"""

import os
import sys
import threading

import numpy as np

from spmd.config.settings import parse_keep_results

__all__ = ["Results", "MIN_ITEMS", "PER_SHAPE"]

#: Results with fewer items are made fresh every time.
MIN_ITEMS = 16 << 10
#: Results of one key kept at a time: a loop that assigns each step's result
#: over the last still holds one while the next is made.
PER_SHAPE = 2
DEFAULT_LIMIT = 1 << 30


def _count(kept, i):
    """Return the reference count of kept[i][0] as seen from here (calibrated below)."""
    return sys.getrefcount(kept[i][0])


# What _count says of an object that only its pool entry holds: measured, since
# the count a call adds differs between Python versions.
_ALONE = _count([[object(), 0]], 0)


def _dropped(kept, i):
    """Tell whether nothing but the pool refers to kept[i]'s buffer."""
    entry = kept[i]
    if _count(kept, i) != _ALONE:
        return False
    alone = entry[1]  # the storage's use count when alone (tensors), else None
    return alone is None or _use_count()(entry[0].untyped_storage()._cdata) == alone


def _default_limit(local_size):
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return DEFAULT_LIMIT
    return min(DEFAULT_LIMIT, memory // (8 * max(1, local_size)))


def limit_from(environ, local_size=1):
    """Return the pool's limit in bytes from SPMD_KEEP_RESULTS, or raise naming the fix.

    The default is 1 GiB, and at most an eighth of the machine's memory
    shared by the local_size ranks on it.
    """
    limit = parse_keep_results(environ)  # spmd.config.settings parses the variable, once for all
    return _default_limit(local_size) if limit is None else limit


class Results:
    """The kept result buffers of one world, shared by its communicators (``Caches.results``)."""

    def __init__(self, limit=None):
        self._limit = limit  # None: read SPMD_KEEP_RESULTS at first use
        self._kept = {}  # key -> [[buffer, storage use count when alone, bytes, signature], ...]
        self._bytes = 0
        # Two threads must never both find one dropped buffer and hand it out.
        self._lock = threading.Lock()

    @property
    def limit(self):
        if self._limit is None:
            self._limit = limit_from(os.environ)
        return self._limit

    def configure_limit(self, limit):
        """Set the limit in bytes (0: keep nothing; None: SPMD_KEEP_RESULTS at first use)."""
        self._limit = limit

    def configure(self, keep_results, local_size=1):
        """Set the limit from SPMD_KEEP_RESULTS as parsed (None: the default) and the ranks on this node."""
        self._limit = _default_limit(local_size) if keep_results is None else keep_results

    def empty(self, key, shape, make, *args):
        """Return a dropped buffer kept under key, else make(*args) (kept when there is room).

        key names the kind, dtype and shape (and whatever else make
        depends on); shape is the result's.
        """
        items = 1
        for d in shape:
            items *= d
        if items < MIN_ITEMS:
            return make(*args)
        with self._lock:
            return self._empty(key, make, args)

    def _empty(self, key, make, args):
        kept = self._kept.get(key)
        if kept is not None:
            i = 0
            while i < len(kept):
                if _dropped(kept, i):
                    entry = kept[i]
                    if _signature(entry[0]) == entry[3]:
                        return entry[0]
                    # The program changed it in place before dropping it
                    # (shape, dtype, storage, requires_grad): never hand it out.
                    self._bytes -= entry[2]
                    del kept[i]
                    continue
                i += 1
        buf = make(*args)
        if self.limit > 0:
            self._keep(key, kept, buf)
        return buf

    def _keep(self, key, kept, buf):
        if isinstance(buf, np.ndarray):
            nbytes, alone = buf.nbytes, None
        else:
            use_count = _use_count()
            if use_count is None or not buf.is_cpu:
                return  # nothing to tell a dropped tensor by: never reuse it
            nbytes, alone = buf.nbytes, use_count(buf.untyped_storage()._cdata)
        if kept is None:
            kept = self._kept[key] = []
        if len(kept) >= PER_SHAPE:
            return
        if self._bytes + nbytes > self.limit:
            self._release(self._bytes + nbytes - self.limit)
            if self._bytes + nbytes > self.limit:
                return
        kept.append([buf, alone, nbytes, _signature(buf)])
        self._bytes += nbytes

    def _release(self, need):
        """Let go of dropped buffers until need bytes are freed or none is left."""
        for key, kept in list(self._kept.items()):
            i = 0
            while i < len(kept) and need > 0:
                if _dropped(kept, i):
                    need -= kept[i][2]
                    self._bytes -= kept[i][2]
                    del kept[i]
                else:
                    i += 1
            if not kept:
                del self._kept[key]
            if need <= 0:
                return

    def clear(self):
        """Let every kept buffer go (the program's own references stay valid)."""
        with self._lock:
            self._kept.clear()
            self._bytes = 0

    @property
    def nbytes(self):
        """Bytes of the buffers kept (dropped or still held by the program)."""
        return self._bytes


def _signature(buf):
    """What must not have changed for buf to be handed out again as a fresh result."""
    if isinstance(buf, np.ndarray):
        return buf.shape, buf.strides, buf.dtype, buf.flags.writeable
    return buf.shape, buf.stride(), buf.dtype, buf.data_ptr(), buf.requires_grad


def _use_count():
    """torch's storage use count, or None where this torch has none."""
    torch = sys.modules.get("torch")
    return getattr(getattr(torch, "_C", None), "_storage_Use_Count", None)

