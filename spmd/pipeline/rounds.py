"""One pipeline round on one rank: read ahead, apply fn, report, write behind.

:class:`Reader` reads the next round's rows in a thread while fn works
on this round's (``overlap=False``: when asked, in the caller's
thread); :class:`Writer` hands root's finished rounds to the output in
a thread. Each holds at most one round besides the one in hand, so a
rank keeps at most two rounds of rows in memory. numpy's generators,
its arithmetic on large arrays, file reads and writes and zlib/crc32c
release the GIL, so the threads do overlap the main thread's work.

:class:`Status` is what a rank tells every other after a round: its
error if any, its rows and their checksums, what fn returned, and how
long the rank took for its part of the round (the speed balance's
measure).
"""

import queue
import threading
import time
from typing import NamedTuple

import numpy as np

from spmd.comms.arrays import is_tensor
from spmd.errors import PipelineTypeError, PipelineValueError

__all__ = ["Status", "Reader", "Writer", "apply", "as_numpy", "describe"]


def describe(exc):
    return f"{type(exc).__name__}: {exc}"


class Status(NamedTuple):
    """What one rank tells the others after a round."""

    error: object = None  # what went wrong on this rank (fn, its read, its write), or None
    pending: object = None  # root only: an earlier failure of reading, writing or checking
    rows: int = 0
    in_crc: int = 0
    row_shape: tuple = ()
    dtype: str = ""
    out_crc: int = 0
    seconds: float = 0.0  # fn alone
    busy: float = 0.0  # since the last exchange of statuses, less any wait for root's scatter
    preempted: bool = False


def as_numpy(x):
    if is_tensor(x):
        return x.detach().cpu().numpy()
    if not isinstance(x, np.ndarray):
        raise PipelineTypeError(f"fn must return a numpy array or a torch tensor, got {type(x).__name__}")
    return x


def apply(fn, part, crc):
    """Apply fn to this rank's block; return (output or None, error, in_crc, out_crc, seconds)."""
    received = crc.of(part)
    t = time.perf_counter()
    try:
        out = as_numpy(fn(part))
        if out.ndim == 0 or out.shape[0] != part.shape[0]:
            raise PipelineValueError(f"fn returned shape {tuple(out.shape)} for a block of {part.shape[0]} rows; "
                                     "it must return one row per input row")
        out = np.ascontiguousarray(out)
    except Exception as exc:
        return None, describe(exc), received, 0, time.perf_counter() - t
    return out, None, received, crc.of(out), time.perf_counter() - t


class _Done(NamedTuple):
    value: object
    error: object
    seconds: float


class Reader:
    """Read rows in request order: in a thread one request ahead (overlap), or when taken.

    read(start, stop) returns the rows; request() queues a range, take()
    returns the oldest one's (rows, error, seconds).
    """

    def __init__(self, read, overlap=True):
        self.read, self.overlap = read, overlap
        self.asked = []
        self.results = queue.Queue()
        self.thread = None
        if overlap:
            self.requests = queue.Queue()
            self.thread = threading.Thread(target=self._run, name="spmd-pipeline-reader", daemon=True)
            self.thread.start()

    def _read(self, span):
        t = time.perf_counter()
        try:
            return _Done(self.read(*span), None, time.perf_counter() - t)
        except Exception as exc:
            return _Done(None, f"reading rows {span[0]} to {span[1]}: {describe(exc)}", time.perf_counter() - t)

    def _run(self):
        while True:
            span = self.requests.get()
            if span is None:
                return
            self.results.put(self._read(span))

    def request(self, start, stop):
        if self.overlap:
            self.requests.put((start, stop))
        else:
            self.asked.append((start, stop))

    def take(self):
        if self.overlap:
            return self.results.get()
        return self._read(self.asked.pop(0))

    def close(self):
        if self.thread is not None:
            self.requests.put(None)
            self.thread.join(timeout=60)
            self.thread = None


class Writer:
    """Run write(item) for each put item, in order: in a thread (overlap) or at once.

    A failure is kept in error (the first one) and later items are
    dropped; finish() waits for everything put so far.
    """

    def __init__(self, write, overlap=True):
        self.write, self.overlap = write, overlap
        self.error = None
        self.thread = None
        if overlap:
            self.items = queue.Queue(maxsize=1)
            self.thread = threading.Thread(target=self._run, name="spmd-pipeline-writer", daemon=True)
            self.thread.start()

    def _do(self, item):
        if self.error is not None:
            return
        try:
            self.write(item)
        except Exception as exc:
            self.error = describe(exc)

    def _run(self):
        while True:
            item = self.items.get()
            try:
                if item is None:
                    return
                self._do(item)
            finally:
                self.items.task_done()

    def put(self, item):
        if self.overlap:
            self.items.put(item)
        else:
            self._do(item)

    def finish(self):
        """Wait until every item put has been written."""
        if self.overlap:
            self.items.join()

    def close(self):
        if self.thread is not None:
            self.items.put(None)
            self.thread.join(timeout=60)
            self.thread = None
