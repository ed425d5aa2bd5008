"""Ending the job when one rank fails: say who failed, then make every rank stop.

``report_failure`` writes the traceback headed by rank, host and pid, or,
when a lower rank failed with the same error (the hub says which), one
line naming that rank; ``abort_job`` ends this process and, through
MPI_Abort or the hub, every other rank; a rank ended because another
failed exits with ``PEER_EXIT``.  ``stacks_report`` asks every rank where
it is (rank 0 prints the report).

This module knows nothing of the runtime: the runtime registers what an
abort needs (its rank and size, how to tell the other ranks, and the
relay that compares failures and gathers stacks: the hub) with
``register`` at init, and takes it back with ``unregister`` at finalize.
"""

import os
import socket
import sys
import time
import traceback
from typing import Any

from spmd.errors import CollectiveTimeout, is_peer_lost

__all__ = [
    "report_everywhere",
    "report_failure",
    "report_message",
    "abort_job",
    "stacks_report",
    "exit_now",
    "who",
    "register",
    "unregister",
    "PEER_EXIT",
    "ABORT_GRACE",
    "PEER_GRACE",
    "SAME_WAIT",
]

#: Exit status of a rank ended because another rank failed.
PEER_EXIT = 75
#: Seconds a failing rank waits between writing its traceback and MPI_Abort.
ABORT_GRACE = 0.25
#: Seconds a rank that lost a peer waits for the hub to name the rank that failed.
PEER_GRACE = 3.0
#: Seconds a rank that printed "same error as rank R" leaves rank R to end the job before it does.
SAME_WAIT = 2.0

# What the runtime registered: this rank and size, the calls that tell the others, the relay.
_world = {"rank": None, "size": None, "tell_others": (), "relay": None}


def register(rank, size, tell_others=(), relay=None):
    """Record the running communicator's rank and size, calls that tell the other ranks of a failure,
    and the relay (the hub: judge, judged, stacks_report) if there is one."""
    _world.update(rank=rank, size=size, tell_others=tuple(tell_others), relay=relay)


def unregister():
    """Forget what register recorded (the runtime has ended)."""
    _world.update(rank=None, size=None, tell_others=(), relay=None)


def exit_now(code, message=None, before=None):
    """Print message (if any), call before() (if given), and end this process at once, from any thread."""
    if message:
        sys.stderr.write(message.rstrip("\n") + "\n")
    try:
        sys.stdout.flush()
        sys.stderr.flush()
        if before is not None:
            before()
    finally:
        os._exit(code)


def who():
    """Name this process: rank, size, host and pid, as far as known."""
    if _world["rank"] is not None:
        name = f"rank {_world['rank']} of {_world['size']}"
    else:
        try:
            from spmd.config.placement import detect

            p = detect()
            name = f"rank {p.rank} of {p.size} (before init)"
        except Exception:
            name = "a rank (before init)"
    return f"{name} on {socket.gethostname()} (pid {os.getpid()})"


def report_failure(exc_type, exc, tb):
    """Write this rank's failure to stderr; return the rank that reports it in full instead, else None.

    In full (a traceback headed by the rank, host and pid) unless the hub
    says a lower rank failed with the same error: then one line naming
    that rank.  Without an answer from the hub (none, or gone) in full.
    """
    if is_peer_lost(exc):
        # Most likely another rank died (or timed out) inside this collective: give
        # the hub a moment to say which, and to end this rank, before blaming this one.
        time.sleep(PEER_GRACE)
    return _report(exc_type, exc, lambda: f"### spmd: {who()} failed:\n"
                   + "".join(traceback.format_exception(exc_type, exc, tb)))


def report_message(message):
    """Write message, a timeout of this rank's not raised (the mpi watcher's), as report_failure would.

    It is compared with the other ranks' errors as a CollectiveTimeout.
    Return as report_failure does (pass it to abort_job's after).
    """
    return _report(CollectiveTimeout, CollectiveTimeout(message), lambda: message.rstrip("\n") + "\n")


def _report(exc_type, exc, full):
    """Write full() or, if the hub says a lower rank reports this error, one line; return that rank."""
    relay, rank = _world["relay"], _world["rank"]
    lead = None
    try:
        if relay is not None:
            try:
                from spmd.failfast.report import digest

                lead = relay.judge(digest(exc_type, exc))
            except Exception:  # never lose a report over the comparison
                lead = None
        if lead is not None and lead != rank:
            sys.stderr.write(f"### spmd: rank {rank}: same error as rank {lead} ({exc_type.__name__}; "
                             f"rank {rank} of {_world['size']} on {socket.gethostname()}, pid {os.getpid()})\n")
        else:
            lead = None
            sys.stderr.write(full())
        sys.stderr.flush()
    finally:
        if relay is not None:
            relay.judged()
    return lead


def stacks_report(timeout=2.0):
    """Ask every rank where it is, as at a hang; rank 0 prints the grouped report; return its text.

    Call it where a call has timed out (the stacks are still where they
    wait).  None where there is no hub (a world of one, before init) or no
    report came within timeout plus a little.
    """
    relay = _world["relay"]
    if relay is None:
        return None
    try:
        return relay.stacks_report(timeout)
    except Exception:  # a report is a courtesy: never in the way of the error itself
        return None


def abort_job(code=1, after=None):
    """End this process now and make every other rank end too.

    after: the rank whose full report this rank's one line pointed to
    (report_failure's return): it is given SAME_WAIT seconds to end the
    job first, so the job ends with its report and status.
    """
    if after is not None:
        time.sleep(SAME_WAIT)
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


def report_everywhere(exc: BaseException) -> None:
    """An error every rank met alike at init (marked by spmd.runtime.said_once.everywhere): rank 0
    prints it at once, every rank waits until it has (so that no launcher ends rank 0 first), and each
    then raises it with ``said`` set: an uncaught one ends the process with status 1 and no second
    report (the excepthook set here; python -m spmd does the same)."""
    rank, said = exc.everywhere  # type: ignore[attr-defined]
    if rank == 0:
        sys.stderr.write(f"### spmd: init failed on every rank ({type(exc).__name__}):\n{exc}\n")
        sys.stderr.flush()
    said()
    exc.said = True  # type: ignore[attr-defined]
    previous = sys.excepthook

    def hook(exc_type: Any, value: BaseException, tb: Any) -> None:
        if not getattr(value, "said", False):
            previous(exc_type, value, tb)

    sys.excepthook = hook
