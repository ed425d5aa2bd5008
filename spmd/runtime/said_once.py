"""An error every rank met alike, said once: by rank 0, while the others wait until it has spoken.

``everywhere(exc, rank, said)`` marks an exception so that spmd.failfast.abort's
``report_everywhere`` prints it on rank 0 only; ``said`` is how the ranks learn that
rank 0 has spoken (a store key, a barrier, or a grace where they share no channel), so
that no launcher ends rank 0 before its words are out.  A rank whose rank 0 never
spoke says the error itself (``say_own``).
"""

import sys
import time
from datetime import timedelta

__all__ = ["QUIET_GRACE", "SAID_WITHIN", "everywhere", "said_by_rank_0", "said_over_store", "say_own"]

#: Seconds a rank other than 0 waits before it ends on an error every rank met alike where it has no
#: channel to rank 0 (plain srun): rank 0 says it, and srun --kill-on-bad-exit must not end rank 0 first.
QUIET_GRACE = 3.0

#: Seconds a rank waits for rank 0 to say an error every rank met alike (await_peers' among them).
SAID_WITHIN = 10.0


def said_by_rank_0(rank, seconds=QUIET_GRACE):
    """A said() for everywhere without a channel between the ranks: the others give rank 0 seconds."""
    def said():
        if rank != 0:
            time.sleep(seconds)
    return said


def everywhere(exc, rank, said):
    """Mark exc as raised alike on every rank, so that rank 0 alone says it (spmd.failfast.abort's
    report_everywhere): rank is this rank's; said(), called by every rank once rank 0 has written
    it, returns when every rank may end (a barrier: no launcher then ends rank 0 before it spoke)."""
    exc.everywhere = (rank, said)
    return exc


def said_over_store(store, rank, seconds=SAID_WITHIN, unsaid=None):
    """A said() for everywhere through a store: rank 0 sets a key, the others wait for it (bounded); a rank
    that waited in vain calls unsaid() (it says the error itself: rank 0 did not)."""
    def said():
        if rank == 0:
            store.set("spmd/said", "1")
            return
        try:
            store.wait(["spmd/said"], timedelta(seconds=seconds))
        except Exception:  # noqa: BLE001 - rank 0 gone: end anyway
            if unsaid is not None:
                unsaid()
    return said


def say_own(rank, exc):
    """Say exc as this rank's own (rank 0 never said it)."""
    sys.stderr.write(f"### spmd: rank {rank}: {type(exc).__name__}: {exc}\n")
    sys.stderr.flush()
