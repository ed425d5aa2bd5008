"""What each rank's collectives were: sequence numbers, call records, trace.

Every call gets a sequence number and a short record, a :class:`Call`
(name, root, op, dtype, shape; peer and tag for point to point), kept in
a small ring, so a timeout can say what this rank last called.  Debug
mode (``SPMD_DEBUG=1``) compares each call's record (its fingerprint)
across ranks before running it, and names the caller's file and line.  Trace mode (``SPMD_TRACE=path``)
records the start and duration of every call; :mod:`spmd.failfast.trace` merges them at finalize.
"""

from __future__ import annotations

import collections
import sys
import time
from typing import Any, NamedTuple

from spmd.errors import CollectiveError, CollectiveTimeout, CommunicationError, PeerLostError
from spmd.util.paths import is_spmd_file

__all__ = ["Call", "named", "Monitor", "fingerprint_mismatch", "timed_out", "P2P"]


# Shape rules: which ranks' shapes must agree for each collective.
_SAME_SHAPE = {"broadcast", "reduce", "all_reduce"}
_SAME_TRAILING = {"gather", "all_gather"}


def _nbytes(x):
    if x is None:
        return 0
    if hasattr(x, "nbytes") and not hasattr(x, "element_size"):
        return int(x.nbytes)
    return x.numel() * x.element_size()


#: Point-to-point calls: their record's peer and tag (kept where a collective's root and op are).
P2P = frozenset(("send", "recv"))


class Call(NamedTuple):
    """What one call was: the record a timeout report, debug mode's check and the trace read.

    On the hot path (:meth:`Monitor.note`) a record is a plain tuple in
    these fields' order, Python's cheapest object; every reader names it
    with :func:`named` (``find``, ``recent``, the errors, debug and trace).
    dtype and shape are the array's own objects until debug mode turns them
    into text (to compare across ranks); where is the caller's 'file:line'
    in debug mode, else None.  A point-to-point call (name in ``P2P``)
    keeps its peer and tag in root's and op's places: read them as
    :attr:`peer` and :attr:`tag`.
    """

    seq: int
    name: str
    root: int | None = None
    op: Any = None
    dtype: Any = None
    shape: tuple = ()
    where: str | None = None

    @property
    def peer(self) -> int | None:
        """The other rank of a send or recv (None: a recv from any rank)."""
        return self.root

    @property
    def tag(self) -> int | None:
        """The user tag of a send or recv."""
        return self.op


#: Where a record keeps its number: the one field the call path reads unnamed (an async wait's).
SEQ = Call._fields.index("seq")

_new = tuple.__new__


def named(record):
    """Return record, a call's record as Monitor.note keeps it (or already a Call), as a Call."""
    return record if type(record) is Call else _new(Call, record)


def caller():
    """Return 'file:line' of the first frame outside the spmd package."""
    frame = sys._getframe(2)
    while frame is not None and is_spmd_file(frame.f_code.co_filename):
        frame = frame.f_back
    if frame is None:
        return "?"
    return f"{frame.f_code.co_filename}:{frame.f_lineno}"


def call_name(call):
    """Name a call (its record) for a report: 'all_reduce', or 'recv from rank 1 (tag 3)'."""
    call = named(call)
    name, peer, tag = call.name, call.peer, call.tag
    if name == "recv":
        return f"recv from {'any rank' if peer is None else f'rank {peer}'} (tag {tag})"
    if name == "send":
        return f"send to rank {peer} (tag {tag})"
    return name


def timed_out(who, what, timeout, waiting_for=None, in_wait=False):
    """Say that a call timed out: 'rank 0: all_reduce (call #3) timed out after 6 s waiting for ...'.

    The words every timeout report starts with (the backend's timeout, the
    mpi watcher's, point to point's own waits); the caller adds the rest.
    in_wait: in an async handle's wait(), said before what it waited for.
    """
    text = f"{who}: {what} timed out after {timeout:g} s"
    if waiting_for is not None:
        text += f" {Monitor.IN_WAIT + ', ' if in_wait else ''}waiting for {waiting_for}"
    return text


def _describe(record):
    call = named(record)
    seq, name, root, op, dtype, shape, where = call
    parts = [f"#{seq} {name}"]
    if name in P2P:
        peer = call.peer
        parts.append(("from any rank" if peer is None else f"from rank {peer}") if name == "recv" else f"to rank {peer}")
        parts.append(f"tag {call.tag}")
        root = op = None
    if root is not None:
        parts.append(f"root={root}")
    if op is not None:
        parts.append(f"op={op}")
    if dtype is not None:
        parts.append(f"{str(dtype).replace('torch.', '')} {tuple(shape)}")
    if where:
        parts.append(f"at {where}")
    return " ".join(parts)


def fingerprint_mismatch(fps):
    """Return a message if the ranks' call records (debug mode's fingerprints) disagree, else None."""
    fps = [named(fp) for fp in fps]
    name = fps[0].name
    keys = []
    for fp in fps:
        n, root, op, dtype, shape = fp.name, fp.root, fp.op, fp.dtype, fp.shape
        if n in _SAME_SHAPE or op == "equal":  # equal=True: one shape on every rank
            keys.append((n, root, op, dtype, tuple(shape)))
        elif n in _SAME_TRAILING:
            keys.append((n, root, dtype, tuple(shape[1:]) if shape else None))
        else:
            keys.append((n, root, op))
    if all(k == keys[0] for k in keys):
        return None
    listing = "\n".join(f"  rank {r}: {_describe(fp)}" for r, fp in enumerate(fps))
    return (
        f"collective mismatch at call #{fps[0].seq} ({name} on rank 0): every rank must call the "
        f"same collective with matching arguments, in the same order:\n{listing}"
    )


class Monitor:
    """Per-communicator bookkeeping of collectives; cheap unless debug or trace."""

    #: How a report says that a call failed in its async handle's wait() (the mpi watcher's too).
    IN_WAIT = "in wait() of its async handle"

    def __init__(self, debug: bool = False, trace: str | None = None, nvtx: bool = False) -> None:
        self.seq = 0
        self.busy = 0  # number of the call this rank blocks in (or in whose async wait()), else 0
        self.waiting = None  # the record of the async call whose handle's wait() this rank blocks in
        self.pending = None  # the Call whose descriptions are being exchanged
        self.ring = collections.deque(maxlen=8)
        self.debug = debug
        self.trace = trace  # path for the merged trace, or None
        self.events = [] if trace else None
        self.nvtx = nvtx
        self.world = True  # the world communicator's (a split's monitor says False)
        self.active = bool(debug or trace or nvtx)
        self.family = [self]  # this monitor and its sub-communicators', for watchdogs
        #: Whether a call may have left something behind: a point-to-point message, a sub-communicator.
        self.dirty = False

    def restart(self):
        """Forget the collectives so far (those the runtime made during init)."""
        self.seq = 0
        self.ring.clear()
        if self.events:
            self.events.clear()

    def child(self):
        """Return a monitor for a sub-communicator, sharing the trace's event list."""
        sub = Monitor(self.debug, None, self.nvtx)
        sub.events = self.events
        sub.world = False
        sub.active = self.active
        sub.family = self.family
        self.family.append(sub)
        return sub

    def forget(self):
        """Leave the family of monitors the watchdogs read (a freed sub-communicator's)."""
        if self in self.family and self.family[0] is not self:
            self.family.remove(self)

    def note(self, name, x=None, root=None, op=None, where=None):
        """Count a call and keep its record; return it (a plain tuple in Call's order: read it by named()).

        For point to point, root and op are the peer and the tag.
        """
        self.seq += 1
        if x is None:
            record = (self.seq, name, root, op, None, (), where)
        else:  # dtype and shape as they are: turned into text only when shown
            record = (self.seq, name, root, op, x.dtype, x.shape, where)
        self.ring.append(record)
        return record

    def upcoming(self, name, x=None, root=None):
        """Return (and keep as pending) the Call the next call will be, without counting it.

        Scatter and the gathers exchange array descriptions before they are
        counted; a timeout there is reported with this record.
        """
        shape = () if x is None else x.shape
        self.pending = Call(self.seq + 1, name, root, None, getattr(x, "dtype", None), shape, None)
        return self.pending

    def find(self, seq):
        """Return the Call numbered seq if known, else None: kept in the ring, in its
        description exchange (pending), or the async call whose wait() this rank blocks in
        (waiting: it may be out of the ring by then)."""
        for record in (self.waiting, self.pending):
            if record is not None and record[SEQ] == seq:
                return named(record)
        return next((named(r) for r in reversed(self.ring) if r[SEQ] == seq), None)

    def calls(self):
        """Return the records of the last calls kept, oldest first, as Calls."""
        return [named(record) for record in self.ring]

    @staticmethod
    def name_of(call):
        """Name a Call for a report: 'all_reduce', or 'recv from rank 1 (tag 3)'."""
        return call_name(call)

    def recent(self):
        """Describe the last collectives this rank called, oldest first."""
        return "; ".join(_describe(call) for call in self.ring) or "none"

    def run(self, record, hook, args, x, async_op, collective, all_gather_object):
        """Run a call with debug checks (collectives only), NVTX ranges and tracing as enabled.

        all_gather_object(obj) gives every rank's obj: the interface the
        communicator declares for debug mode's cross-rank check (its backend's
        hook, below the call path, so the check is not itself a call).
        """
        call = named(record)
        if self.debug:
            dtype = None if call.dtype is None else str(call.dtype).replace("torch.", "")
            call = call._replace(dtype=dtype, shape=tuple(call.shape), where=caller())
            self.ring[-1] = call
            if collective:  # point to point is checked by its receiver (spmd.comms.p2p.methods)
                error = fingerprint_mismatch(all_gather_object(call))
                if error:
                    raise CollectiveError(error)
        if self.nvtx:
            import torch

            torch.cuda.nvtx.range_push(f"spmd.{call.name}")
        wall, start = time.time(), time.perf_counter()
        try:
            result = hook(*args)
        finally:
            if self.nvtx:
                torch.cuda.nvtx.range_pop()
        if self.events is not None:
            self._record(call, x, wall, start, result, async_op)
        return result

    def _record(self, call, x, wall, start, result, async_op):
        if x is None and hasattr(result, "shape"):  # scatter: what arrived here
            x = result
        if call.name == "recv" and not async_op and x is None:  # the array received, and from whom
            x, peer = result
        else:
            peer = call.peer
        event = {"name": call.name, "seq": call.seq, "bytes": _nbytes(x), "ts": wall, "dur": None}
        if call.name in P2P:
            event["peer"], event["tag"] = peer, call.tag
        if not self.world:
            event["sub"] = True  # a split's call: its ranks and numbers are not the world's
        if async_op:
            event["async"] = True  # timed to when its completion was seen, not to when it was over
        self.events.append(event)
        if not async_op:
            event["dur"] = time.perf_counter() - start
            return

        def timed():  # a Handle: timed up to its completion
            event["dur"] = time.perf_counter() - start

        result.on_complete(timed)

    def timeout_error(self, backend, call, exc, peers=None, waiting=False):
        """Turn a backend's timeout in call (waiting: in its handle's wait()) into a CollectiveTimeout.

        backend: the communicator's transport, read for its rank, timeout and name.
        """
        call = named(call)
        others = "its peer" if call.name in P2P else "the other ranks"
        what = f"{call_name(call)} (call #{call.seq})"
        message = f"{timed_out(f'rank {backend.rank}', what, backend.timeout, others, waiting)} ({backend.name}: {first_line(exc)})"
        if peers:
            message += f". {peers}"
        message += f". Last collectives on this rank: {self.recent()}"
        return CollectiveTimeout(message)

    def failure(self, backend, call, exc, lost, waiting=False):
        """Turn a backend's other error in call into a PeerLostError (lost) or a CommunicationError."""
        call = named(call)
        message = (
            f"rank {backend.rank}: {call_name(call)} (call #{call.seq}) failed{' ' + self.IN_WAIT if waiting else ''} "
            f"({backend.name}: {first_line(exc)})"
        )
        if lost:
            message += ": a peer died or closed its connection (see the other ranks' errors)"
        message += f". Last collectives on this rank: {self.recent()}"
        return (PeerLostError if lost else CommunicationError)(message)


def first_line(exc):
    """The first line of a backend's error, at most 200 characters: what a report quotes."""
    text = str(exc)
    return (text.splitlines()[0] if text else type(exc).__name__)[:200]
