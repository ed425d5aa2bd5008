"""Ending the job when one rank fails: say who failed, then make every rank stop.

``report_failure`` writes the traceback headed by rank, host and pid;
``abort_job`` ends this process and, through MPI_Abort or the hub, every
other rank; a rank ended because another failed exits with ``PEER_EXIT``.

This module knows nothing of the runtime: the runtime registers what an
abort needs (its rank and size, and how to tell the other ranks) with
``register`` at init, and takes it back with ``unregister`` at finalize.
"""

import os
import socket
import sys
import time
import traceback

from .errors import is_peer_lost

__all__ = [
    "report_failure",
    "abort_job",
    "exit_now",
    "who",
    "register",
    "unregister",
    "PEER_EXIT",
    "ABORT_GRACE",
    "PEER_GRACE",
]

#: Exit status of a rank ended because another rank failed.
PEER_EXIT = 75
#: Seconds a failing rank waits between writing its traceback and MPI_Abort.
ABORT_GRACE = 0.25
#: Seconds a rank that lost a peer waits for the hub to name the rank that failed.
PEER_GRACE = 3.0

# What the runtime registered: this rank and size, and the calls that tell the others.
_world = {"rank": None, "size": None, "tell_others": ()}


def register(rank, size, tell_others=()):
    """Record the running communicator's rank and size, and calls that tell the other ranks of a failure."""
    _world.update(rank=rank, size=size, tell_others=tuple(tell_others))


def unregister():
    """Forget what register recorded (the runtime has ended)."""
    _world.update(rank=None, size=None, tell_others=())


def exit_now(code, message=None):
    """Print message (if any) and end this process at once, from any thread."""
    if message:
        sys.stderr.write(message.rstrip("\n") + "\n")
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


def who():
    """Name this process: rank, size, host and pid, as far as known."""
    if _world["rank"] is not None:
        name = f"rank {_world['rank']} of {_world['size']}"
    else:
        try:
            from .placement import detect

            p = detect()
            name = f"rank {p.rank} of {p.size} (before init)"
        except Exception:
            name = "a rank (before init)"
    return f"{name} on {socket.gethostname()} (pid {os.getpid()})"


def report_failure(exc_type, exc, tb):
    """Write a traceback headed by the failing rank, host and pid to stderr."""
    if is_peer_lost(exc):
        # Most likely another rank died (or timed out) inside this collective: give
        # the hub a moment to say which, and to end this rank, before blaming this one.
        time.sleep(PEER_GRACE)
    text = "".join(traceback.format_exception(exc_type, exc, tb))
    sys.stderr.write(f"### spmd: {who()} failed:\n{text}")
    sys.stderr.flush()


def abort_job(code=1):
    """End this process now and make every other rank end too."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        sys.stdout.flush()
        sys.stderr.flush()
        # MPICH's mpirun kills every rank as soon as it hears of the abort, and
        # under load it has dropped output it had not yet forwarded, this
        # rank's traceback included: give its forwarding a moment first.
        time.sleep(ABORT_GRACE)
        mpi.COMM_WORLD.Abort(code)  # the launcher ends every rank, with this code
    for tell in _world["tell_others"]:
        tell()
    exit_now(code)
