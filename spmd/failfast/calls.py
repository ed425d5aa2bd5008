"""What each rank's collectives were: sequence numbers, fingerprints, trace.

Every collective gets a sequence number and a short fingerprint (name,
root, op, dtype, shape) kept in a small ring, so a timeout can say what
this rank last called.  Debug mode (``SPMD_DEBUG=1``) compares the
fingerprint of each call across ranks before running it, and names the
caller's file and line.  Trace mode (``SPMD_TRACE=path``) records the
start and duration of every collective; at finalize rank 0 prints a
table and writes a Chrome trace merged across ranks.
"""

import collections
import json
import os
import sys
import time

from spmd.errors import CollectiveError, CollectiveTimeout, CommunicationError, PeerLostError
from spmd.util.bandwidth import BUS_FACTORS, bus_factor
from spmd.util.paths import is_spmd_file

__all__ = ["Monitor", "fingerprint_mismatch", "summarize", "chrome_trace", "BUS_FACTORS"]


# Shape rules: which ranks' shapes must agree for each collective.
_SAME_SHAPE = {"broadcast", "reduce", "all_reduce"}
_SAME_TRAILING = {"gather", "all_gather"}



def _nbytes(x):
    if x is None:
        return 0
    if hasattr(x, "nbytes") and not hasattr(x, "element_size"):
        return int(x.nbytes)
    return x.numel() * x.element_size()


#: Point-to-point calls: their fingerprint's root is the peer, and op the tag.
P2P = frozenset(("send", "recv"))


def caller():
    """Return 'file:line' of the first frame outside the spmd package."""
    frame = sys._getframe(2)
    while frame is not None and is_spmd_file(frame.f_code.co_filename):
        frame = frame.f_back
    if frame is None:
        return "?"
    return f"{frame.f_code.co_filename}:{frame.f_lineno}"


_caller = caller


def call_name(fp):
    """Name a call for a report: 'all_reduce', or 'recv from rank 1 (tag 3)'."""
    name, peer, tag = fp[1], fp[2], fp[3]
    if name == "recv":
        return f"recv from {'any rank' if peer is None else f'rank {peer}'} (tag {tag})"
    if name == "send":
        return f"send to rank {peer} (tag {tag})"
    return name


def _describe(fp):
    seq, name, root, op, dtype, shape, where = fp
    parts = [f"#{seq} {name}"]
    if name in P2P:
        parts.append(("from any rank" if root is None else f"from rank {root}") if name == "recv" else f"to rank {root}")
        parts.append(f"tag {op}")
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
    """Return a message if the ranks' fingerprints disagree, else None."""
    name = fps[0][1]
    keys = []
    for fp in fps:
        _, n, root, op, dtype, shape, _ = fp
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
        f"collective mismatch at call #{fps[0][0]} ({name} on rank 0): every rank must call the "
        f"same collective with matching arguments, in the same order:\n{listing}"
    )


class Monitor:
    """Per-communicator bookkeeping of collectives; cheap unless debug or trace."""

    #: How a report says that a call failed in its async handle's wait() (the mpi watcher's too).
    IN_WAIT = "in wait() of its async handle"

    def __init__(self, debug=False, trace=None, nvtx=False):
        self.seq = 0
        self.busy = 0  # number of the call this rank blocks in (or in whose async wait()), else 0
        self.waiting = None  # fingerprint of the async call whose handle's wait() this rank blocks in
        self.pending = None  # fingerprint of the call whose descriptions are being exchanged
        self.ring = collections.deque(maxlen=8)
        self.debug = debug
        self.trace = trace  # path for the merged trace, or None
        self.events = [] if trace else None
        self.nvtx = nvtx
        self.active = bool(debug or trace or nvtx)
        self.family = [self]  # this monitor and its sub-communicators', for watchdogs

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
        sub.active = self.active
        sub.family = self.family
        self.family.append(sub)
        return sub

    def note(self, name, x=None, root=None, op=None, where=None):
        """Count a collective and keep its fingerprint; return it."""
        self.seq += 1
        if x is None:
            fp = (self.seq, name, root, op, None, (), where)
        else:  # dtype and shape as they are: turned into text only when shown
            fp = (self.seq, name, root, op, x.dtype, x.shape, where)
        self.ring.append(fp)
        return fp

    def upcoming(self, name, x=None, root=None):
        """Return (and keep as pending) the fingerprint the next call will get, without counting it.

        Scatter and the gathers exchange array descriptions before they are
        counted; a timeout there is reported with this fingerprint.
        """
        shape = () if x is None else x.shape
        self.pending = (self.seq + 1, name, root, None, getattr(x, "dtype", None), shape, None)
        return self.pending

    def find(self, seq):
        """Return the fingerprint of call seq if known, else None: kept in the ring, in its
        description exchange (pending), or the async call whose wait() this rank blocks in
        (waiting: it may be out of the ring by then)."""
        for fp in (self.waiting, self.pending):
            if fp is not None and fp[0] == seq:
                return fp
        return next((f for f in reversed(self.ring) if f[0] == seq), None)

    @staticmethod
    def name_of(fp):
        """Name call fp for a report: 'all_reduce', or 'recv from rank 1 (tag 3)'."""
        return call_name(fp)

    def recent(self):
        """Describe the last collectives this rank called, oldest first."""
        return "; ".join(_describe(fp) for fp in self.ring) or "none"

    def run(self, comm, fp, hook, args, x, async_op, collective=True):
        """Run a call with debug checks (collectives only), NVTX ranges and tracing as enabled."""
        if self.debug:
            dtype = None if fp[4] is None else str(fp[4]).replace("torch.", "")
            fp = fp[:4] + (dtype, tuple(fp[5]), _caller())
            self.ring[-1] = fp
            if collective:  # point to point is checked by its receiver (spmd.comms.p2p.methods)
                error = fingerprint_mismatch(comm._all_gather_object(fp))
                if error:
                    raise CollectiveError(error)
        if self.nvtx:
            import torch

            torch.cuda.nvtx.range_push(f"spmd.{fp[1]}")
        wall, start = time.time(), time.perf_counter()
        try:
            result = hook(*args)
        finally:
            if self.nvtx:
                torch.cuda.nvtx.range_pop()
        if self.events is not None:
            self._record(comm, fp, x, wall, start, result, async_op)
        return result

    def _record(self, comm, fp, x, wall, start, result, async_op):
        if x is None and hasattr(result, "shape"):  # scatter: what arrived here
            x = result
        if fp[1] == "recv" and not async_op and x is None:  # the array received, and from whom
            x, peer = result
        else:
            peer = fp[2]
        event = {"name": fp[1], "seq": fp[0], "bytes": _nbytes(x), "ts": wall, "dur": None}
        if fp[1] in P2P:
            event["peer"], event["tag"] = peer, fp[3]
        self.events.append(event)
        if not async_op:
            event["dur"] = time.perf_counter() - start
            return
        finish = result._finish  # a Handle: time it up to its completion

        def timed():
            event["dur"] = time.perf_counter() - start
            return finish()

        result._finish = timed

    def timeout_error(self, comm, fp, exc, peers=None, waiting=False):
        """Turn a backend's timeout in call fp (waiting: in its handle's wait()) into a CollectiveTimeout."""
        message = (
            f"rank {comm.rank}: {call_name(fp)} (call #{fp[0]}) timed out after {comm.timeout:g} s "
            f"{self.IN_WAIT + ', ' if waiting else ''}waiting for {'its peer' if fp[1] in P2P else 'the other ranks'} "
            f"({comm.backend}: {first_line(exc)})"
        )
        if peers:
            message += f". {peers}"
        message += f". Last collectives on this rank: {self.recent()}"
        return CollectiveTimeout(message)

    def failure(self, comm, fp, exc, lost, waiting=False):
        """Turn a backend's other error in call fp into a PeerLostError (lost) or a CommunicationError."""
        message = (
            f"rank {comm.rank}: {call_name(fp)} (call #{fp[0]}) failed{' ' + self.IN_WAIT if waiting else ''} "
            f"({comm.backend}: {first_line(exc)})"
        )
        if lost:
            message += ": a peer died or closed its connection (see the other ranks' errors)"
        message += f". Last collectives on this rank: {self.recent()}"
        return (PeerLostError if lost else CommunicationError)(message)


def first_line(exc):
    """The first line of a backend's error, at most 200 characters: what a report quotes."""
    text = str(exc)
    return (text.splitlines()[0] if text else type(exc).__name__)[:200]


def summarize(events, size):
    """Return rows (op, count, bytes, seconds, algbw, busbw) from all ranks' events."""
    by_op = collections.defaultdict(lambda: [0, 0, 0.0])
    for e in events:
        if e["dur"] is None:
            continue
        row = by_op[e["name"]]
        row[0] += 1
        row[1] += e["bytes"]
        row[2] += e["dur"]
    rows = []
    for name, (count, nbytes, seconds) in sorted(by_op.items()):
        algbw = nbytes / seconds if seconds > 0 else 0.0
        factor = bus_factor(name, size) if size > 1 else 1.0
        rows.append((name, count, nbytes, seconds, algbw, algbw * factor))
    return rows


def format_summary(rows, size):
    """Render summarize()'s rows as a text table (times summed over ranks)."""
    lines = [
        f"spmd trace: collectives over {size} ranks (times and bytes summed over ranks)",
        f"{'op':<18}{'count':>8}{'bytes':>14}{'time s':>10}{'algbw GB/s':>12}{'busbw GB/s':>12}",
    ]
    for name, count, nbytes, seconds, algbw, busbw in rows:
        lines.append(
            f"{name:<18}{count:>8}{nbytes:>14}{seconds:>10.4f}{algbw / 1e9:>12.3f}{busbw / 1e9:>12.3f}"
        )
    return "\n".join(lines)


def chrome_trace(per_rank):
    """Return a Chrome trace (Perfetto-readable) from each rank's events."""
    out = []
    for rank, events in enumerate(per_rank):
        out.append({"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank}"}})
        for e in events:
            out.append({
                "name": e["name"],
                "ph": "X",
                "pid": rank,
                "tid": 0,
                "ts": e["ts"] * 1e6,
                "dur": (e["dur"] or 0.0) * 1e6,
                "args": {"seq": e["seq"], "bytes": e["bytes"],
                         **{k: e[k] for k in ("peer", "tag") if k in e}},
            })
    return {"traceEvents": out, "displayTimeUnit": "ms"}


def write_trace(path, per_rank):
    """Write the merged Chrome trace to path, atomically when it is a regular file."""
    if os.path.exists(path) and not os.path.isfile(path):  # a device or a pipe: write into it
        with open(path, "w") as f:
            json.dump(chrome_trace(per_rank), f)
        return
    from spmd.util.atomic import atomic_write

    with atomic_write(path, text=True) as f:
        json.dump(chrome_trace(per_rank), f)
