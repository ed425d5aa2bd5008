"""Where each rank was when a collective timed out, told through the rendezvous store.

A torch backend's timeout says only that this rank waited too long.  Each
rank that times out (or sees a peer hang up) writes the collective it
was in under ``spmd/stuck/<group>/<rank>``; the report waits a few
seconds for the others' keys and names who was where, and who never came.
"""

import time

__all__ = ["key", "note", "report"]


def key(ranks, rank):
    """Return the store key of rank in the group of these global ranks (None: the world)."""
    tag = "world" if ranks is None else "-".join(map(str, ranks))
    return f"spmd/stuck/{tag}/{rank}"


def note(store, ranks, rank, call, why=""):
    """Write where this rank is stuck (call, a spmd.failfast.calls.Call); never raise."""
    if store is None:
        return
    try:
        store.set(key(ranks, rank), f"#{call.seq} {call.name} {why}".rstrip())
    except Exception:  # the store may be gone with rank 0
        pass


#: Seconds a timed-out rank waits for the others to say where they wait.
WAIT = 2.0


def report(store, ranks, rank, size, call, timeout):
    """Say where the other ranks were stuck, waiting a few seconds for them; None if unknowable."""
    if store is None:
        return None
    try:
        store.set(key(ranks, rank), f"#{call.seq} {call.name}")
        # A short wait: the report of every rank's stack (spmd.failfast.report), asked for first,
        # already gave the others time to time out, and shows where those not in a call are.
        deadline = time.monotonic() + min(WAIT, timeout or WAIT)
        while True:
            here = [r for r in range(size) if store.check([key(ranks, r)])]
            if len(here) == size or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        where = {r: store.get(key(ranks, r)).decode() for r in here}
    except Exception:  # the store itself may be gone with rank 0
        return None
    waiting = ", ".join(f"rank {r} in {w}" for r, w in sorted(where.items()))
    missing = [r for r in range(size) if r not in where]
    text = f"Timed out too: {waiting}"
    if missing:
        text += f"; ranks {missing} never arrived (still computing, blocked elsewhere, or dead)"
    return text
