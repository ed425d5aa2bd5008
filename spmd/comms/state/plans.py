"""Kept direct-path calls on small torch tensors: their MPI buffers and result views, made once.

For a torch tensor, the Python that reads its address for MPI costs about
0.5 µs and each view of it 0.7-0.8 µs here: an ``all_gather(x, equal=True,
out=buf)`` of 8 B spent 3.4 µs of its 4.5 on them, against 0.4 µs in
MPI_Allgather itself.  A call repeated on the same small tensors (a metric
gathered every step) finds its plan here instead.

A plan is found by the call's name, root and the identity of its tensors,
and used only while every tensor it was made from is alive and still has
the address and shape it had and is contiguous, and every view it hands out
still has its shape: a tensor changed in place (``resize_``, ``set_``,
``t_``, ``unsqueeze_``) or one that died and whose id was reused gets a new
plan.  (The checks cost 0.1-0.2 µs a tensor; a dtype reinterpreted through
``.data =`` at the same address and shape is not noticed.)  Only tensors of at most
``LIMIT`` bytes are planned (above it MPI's time dwarfs the Python), so the
views a plan keeps hold at most ``LIMIT`` bytes each alive after the
program drops them, ``caches.PLAN_COUNT`` plans at a time.
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
