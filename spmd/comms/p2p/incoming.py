"""A point-to-point receive in flight: its header first, then its data.

The header (the array's description) is received first; the data's
receive is posted once it has come, into a new array of the described
kind, dtype and shape, or into ``out``.  On a backend whose receives take
messages shorter than their buffer (the backend's ``inline_bytes`` > 0: mpi, gloo), data of
at most that many bytes comes in the header's message itself, and is
copied out of it (:func:`land`).  :class:`Incoming` is moved on by
whoever waits (MPI: a test makes progress); :class:`Threaded` waits for
its header in a thread of its own (gloo: a work completes only when
waited for).
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from spmd.errors import CollectiveError, CollectiveTimeout
from spmd.failfast.calls import timed_out
from spmd.comms.state import meta
from spmd.comms.arrays import contiguous

__all__ = ["Incoming", "Threaded", "all_done", "land", "header_buffer", "receive_buffers", "HEADER", "DATA",
           "WHERE", "VERDICT", "TAG_STRIDE", "HEADER_BYTES", "INLINE_BYTES"]

#: What each of the backend's tags of one user tag carries.
HEADER, DATA, WHERE, VERDICT = 1, 2, 3, 4
TAG_STRIDE = 8
#: Bytes of a header row; inline data follows them in the header's message.
HEADER_BYTES = meta.WIDTH * 8
#: The most data a backend that can should send inline: header and data then make at most
#: 4000 B, under the eager limits measured here (Open MPI's shared memory sends 4000 B eagerly
#: and 4050 not; MPICH's about 8100), so a blocking send eager in raw MPI stays eager.
INLINE_BYTES = 4000 - HEADER_BYTES


def _nbytes(x):
    return x.nbytes if isinstance(x, np.ndarray) else x.numel() * x.element_size()


def all_done(works):
    """Tell whether every work (a Handle, or None for one already over) is complete."""
    return all(w is None or w.is_completed() for w in works)


_DONE = object()  # a data receive that is over (or had nothing to receive)


def header_buffer(comm):
    """A new buffer for a header's message: the row, then room for inline data."""
    return np.empty(meta.WIDTH + -(-comm._backend.inline_bytes // 8), np.int64)


def receive_buffers(comm: Any) -> tuple[Any, Any, Any]:
    """Where comm's blocking receives land, one at a time: (header, its row, the row's tail bytes).

    The header buffer (a header_buffer) takes a message's header and inline
    data; the row and tail are views of it, read when checking what came.
    """
    header = header_buffer(comm)
    return header, header[: meta.WIDTH], header.view(np.uint8)[8 : meta.WIDTH * 8]


def land(comm, header, c, source, base, pending):
    """The header (a header_buffer) from source has come; c is where its data goes (contiguous).

    Returns _DONE when the data is already in c (none, or inline: copied
    out of the header's message), else the data's receive: a Handle when
    pending, else _DONE after receiving it.
    """
    n = _nbytes(c)
    if not n:
        return _DONE
    if n <= comm._backend.inline_bytes:
        comm._backend.bytes_of(c)[:] = header.view(np.uint8)[HEADER_BYTES : HEADER_BYTES + n]
        return _DONE
    if pending:
        return comm._backend.recv(c, source, base + DATA, True)
    comm._backend.recv(c, source, base + DATA, False)
    return _DONE


class Incoming:
    """One receive: its header first (posted at once), then its data (posted when the header has come)."""

    def __init__(self, comm, src, base, out, pending):
        self.comm, self.base, self.out = comm, base, out
        self.header = header_buffer(comm)
        self.head = comm._backend.recv(self.header, src, base + HEADER, pending)  # a Handle, or (blocking) the source
        self.data = None  # the data's receive once posted: a Handle, or _DONE
        self.source = self.result_ = self.error = self.back = self.keep = None
        self.pending = pending
        if not pending:
            self.source = self.head
            self._post()

    def advance(self, block=False):
        """Post the data receive once the header has come; tell whether it is posted."""
        if self.data is None:
            if block:
                self.comm._progressing([self.head])  # may move this receive on too
            elif not self.head.is_completed():
                return False
            if self.data is None:  # never post the data receive twice
                self.source = self.head.wait()
                self._post()
        return True

    def _post(self):
        comm = self.comm
        if self in comm._incoming:
            comm._incoming.remove(self)
        target, self.result_, self.error = comm._prepare(self.header, self.source, self.base, self.out)
        c, self.back = contiguous(target)
        self.keep = c
        self.data = land(comm, self.header, c, self.source, self.base, self.pending)

    def test(self):
        return self.advance() and (self.data is _DONE or self.data.is_completed())

    def wait(self):
        self.advance(block=True)
        if self.data is not _DONE:
            self.comm._progressing([self.data])

    def result(self):
        if self.error:
            raise CollectiveError(self.error)
        if self.back is not None:
            self.back()
        return self.result_


class Threaded(Incoming):
    """An immediate receive where waiting is the only progress (gloo): a thread of its own waits
    for the header and posts the data receive.  It starts at the first test or wait of this
    receive, or at any wait of this communicator's point to point (which is what lets a
    peer's large message complete while this rank waits for its own send)."""

    def __init__(self, comm, src, base, out, pending):
        self._thread, self._over, self._failed = None, threading.Event(), None
        super().__init__(comm, src, base, out, pending)

    def advance(self, block=False):
        if self._thread is None:
            if self in self.comm._incoming:
                self.comm._incoming.remove(self)
            self._thread = threading.Thread(target=self._run, name="spmd-irecv", daemon=True)
            self._thread.start()
        if block:
            self._finish_thread()
        return self._over.is_set()

    def _run(self):
        try:
            self.source = self.head.wait()
            self._post()
            if self.data is not _DONE:
                self.data.wait()
        except BaseException as exc:  # raised again by wait(), on the caller's thread
            self._failed = exc
        finally:
            self._over.set()

    def _finish_thread(self):
        timeout = self.comm.timeout
        if not self._over.wait(None if timeout is None else timeout + 5.0):
            raise CollectiveTimeout(
                timed_out(f"rank {self.comm.rank}", f"an immediate receive (tag {self.base // TAG_STRIDE})", timeout)
                + f": no message came; last calls on this rank: {self.comm._mon.recent()}"
            )
        self._thread.join()
        if self._failed is not None:
            raise self._failed

    def test(self):
        return self.advance()

    def wait(self):
        self.advance(block=True)
