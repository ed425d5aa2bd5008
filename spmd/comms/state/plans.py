"""Kept direct-path calls on small torch tensors: their MPI buffers and result views, made once.

A call repeated on the same small tensors (a metric gathered every step)
finds its plan here instead of reading addresses and making views again.
A plan is found by the call's name, root and the identity of its tensors,
and used only while they are alive, unchanged and contiguous; only tensors
of at most ``LIMIT`` bytes are planned.  What it costs and what it checks:
docs/comms.md, "Plans".
"""

import weakref

__all__ = ["LIMIT", "find", "keep", "handing_out"]

#: Tensors larger than this many bytes are never planned.
LIMIT = 64 << 10


def find(kept, key, tensors):
    """Return the plan kept under key for these tensors if it still holds, else None."""
    entry = kept.table.get(key)
    if entry is None:
        return None
    checks, plan, own = entry
    for t, (ref, ptr, shape) in zip(tensors, checks):
        if ref() is not t or t.data_ptr() != ptr or t.shape != shape or not t.is_contiguous():
            return None
    for t, shape in own:
        if t.shape != shape:
            return None
    return plan


def keep(kept, key, tensors, plan, own=()):
    """Keep plan under key for these tensors (own: the views it hands out); return plan."""
    if kept.count > 0 and all(t.nbytes <= LIMIT for t in tensors):
        checks = [(weakref.ref(t), t.data_ptr(), t.shape) for t in tensors]
        kept.put(key, (checks, plan, [(t, t.shape) for t in own]))
    return plan


def handing_out(pieces, fn, *args):
    """Run fn(*args), an MPI call that fills pieces' memory, and return a new list of the pieces."""
    fn(*args)
    return list(pieces)
