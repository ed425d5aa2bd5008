"""Scatter, process, gather: apply a per-record function to a table on every rank.

Root reads the input, hands each rank a block of rows (uneven when the
rows do not divide by the world size), every rank applies ``fn`` to its
block, and the results come back to root in row order, where they are
checked (record counts and CRC-32 checksums of every block, both ways),
written, and optionally recomputed serially. With ``chunk_rows`` root
streams the input in rounds, so its memory stays bounded however large
the input is; the output is the same::

    from spmd import comm
    from spmd.pipeline import pipeline

    def fn(block):                        # one output row per input row
        return block * 2.0

    result = pipeline(fn, "table.npy", output="doubled.npy", chunk_rows=100_000)
    if comm.rank == 0:                    # the result lives on root
        print(result.summary())

Run it with ``mpirun -n 8 python mine.py`` or ``spmd run -n 8 mine.py``,
or plain python for a world of one. The input (root only) is an
array, a path (.npy file, directory of .npy shards, .csv), a source
object with ``shape``, ``dtype`` and ``read(start, stop)`` such as
:class:`SyntheticTable`, or a callable returning one of these, called on
root only. For an output that is bitwise identical at every world size
and chunking, ``fn`` must compute each row independently of how rows
are batched; :func:`spmd.tasks.fixed_batches` makes that easy.

This module does not import torch; ``fn`` may return tensors.
"""

import time
import zlib
from typing import NamedTuple

import numpy as np

from .comms.arrays import is_tensor, split_sizes
from .errors import PipelineError, PipelineTypeError, PipelineValueError
from .progress import PHASES, Bar, Laps, Result
from .sinks import open_sink
from .sources import ArraySource, CsvSource, NpySource, ShardSource, SyntheticTable, open_source

__all__ = [
    "pipeline",
    "Result",
    "PipelineError",
    "on_root",
    "open_source",
    "ArraySource",
    "NpySource",
    "ShardSource",
    "CsvSource",
    "SyntheticTable",
    "PHASES",
]


def _describe(exc):
    return f"{type(exc).__name__}: {exc}"


def _comm(comm):
    if comm is not None:
        return comm
    from . import comm as world

    return world


def on_root(work, *, comm=None, root=0, share=False):
    """Run ``work()`` on root alone and raise the same error everywhere if it fails.

    Returns work()'s value on root and None elsewhere, or root's value on
    every rank with ``share=True`` (it must then pickle). Every rank
    must call on_root, so a failure on root never leaves the others
    waiting in the next collective.
    """
    comm = _comm(comm)
    value = error = None
    if comm.rank == root:
        try:
            value = work()
        except Exception as exc:
            error = _describe(exc)
    reply = comm.broadcast_object(("error", error) if error else ("ok", value if share else None), root)
    if reply[0] == "error":
        raise PipelineError(f"on rank {root}: {reply[1]}")
    return value if comm.rank == root else reply[1]


# -- the pipeline ----------------------------------------------------------------------


def _crc(a, start=0):
    """Return the CRC-32 of a's bytes in C order, continuing from start."""
    return zlib.crc32(np.ascontiguousarray(a).reshape(-1).view(np.uint8), start)


def _as_numpy(x):
    if is_tensor(x):
        return x.detach().cpu().numpy()
    if not isinstance(x, np.ndarray):
        raise PipelineTypeError(f"fn must return a numpy array or a torch tensor, got {type(x).__name__}")
    return x


class _Root:
    """Root's side of a run: read, split, check, write, verify, keep the books.

    A failure is kept in ``pending`` and travels in root's next
    broadcast, so every rank raises the same error.
    """

    def __init__(self, comm, fn, verify, timer):
        self.comm, self.fn, self.verify, self.lap = comm, fn, verify, timer
        self.pending = None
        self.in_crc = self.out_crc = 0
        self.rows_out = 0
        self.mismatched, self.first_bad = 0, None
        self.empty = None

    def open(self, source, output, chunk_rows, progress):
        """Open the input and the output; return the plan to broadcast."""
        try:
            if callable(source) and not hasattr(source, "read"):
                source = source()
            self.src = open_source(source)
            rows = int(self.src.shape[0])
            chunk = int(chunk_rows) if chunk_rows else max(rows, 1)
            if chunk < 1:
                raise PipelineValueError(f"chunk_rows must be at least 1, got {chunk_rows}")
            self.sink = open_sink(output, rows)
            self.bar = Bar() if progress is True else progress or None
            return ("ok", rows, chunk)
        except Exception as exc:
            return ("error", f"cannot open the input: {_describe(exc)}")
        finally:
            self.lap("load")

    def load(self, a, b):
        """Read rows a to b and split them into one block per rank."""
        if self.pending is not None:
            return None
        try:
            block = self.src.read(a, b)
            if block.shape[0] != b - a or block.shape[1:] != tuple(self.src.shape[1:]):
                raise PipelineValueError(f"reading rows {a} to {b} gave shape {block.shape}")
            self.lap("load")
            parts = np.split(block, np.cumsum(split_sizes(b - a, self.comm.size))[:-1])
            self.sent = [_crc(p) for p in parts]
            self.in_crc = _crc(block, self.in_crc)
            # fn may change its block in place; verify needs the rows as read
            self.kept = block.copy() if self.verify else None
            self.lap("check")
            return parts
        except Exception as exc:
            self.pending = f"reading rows {a} to {b}: {_describe(exc)}"
            return None

    def receive(self, a, b, statuses, got):
        """Check what came back against what the ranks say they sent, then write it."""
        if self.pending is not None:
            return
        try:
            for r, (s, g) in enumerate(zip(statuses, got)):
                if s.in_crc != self.sent[r]:
                    raise PipelineError(f"rows {a} to {b}: rank {r} received {s.rows} rows with crc32 "
                                        f"{s.in_crc:08x}, not the rows with crc32 {self.sent[r]:08x} sent")
                if g.shape[0] != s.rows or _crc(g) != s.out_crc:
                    raise PipelineError(f"rows {a} to {b}: rank {r} sent back {s.rows} rows with crc32 "
                                        f"{s.out_crc:08x}, but {g.shape[0]} rows with crc32 {_crc(g):08x} arrived")
                self.out_crc = _crc(g, self.out_crc)
                self.rows_out += g.shape[0]
            result = got[0] if len(got) == 1 else np.concatenate(got)
            self.empty = result[:0]
            self.lap("check")
            self.sink(a, result)
            self.lap("write")
            if self.verify:
                self._verify(a, result)
                self.lap("verify")
            if self.bar:
                self.bar(b, self.src.shape[0])
        except Exception as exc:
            self.pending = f"after rows {a} to {b}: {_describe(exc)}"

    def _verify(self, a, result):
        expect = np.ascontiguousarray(_as_numpy(self.fn(self.kept)))
        bad = _differing_rows(result, expect)
        if bad.size:
            self.mismatched += int(bad.size)
            if self.first_bad is None:
                self.first_bad = a + int(bad[0])

    def close(self, rows):
        """Finish the output; return what the Result shows as output."""
        try:
            if self.pending is None and self.rows_out != rows:
                self.pending = f"{rows} rows were read but {self.rows_out} came back"
            return self.sink.close(self.pending is None, self.empty)
        except Exception as exc:
            self.pending = f"finishing the output: {_describe(exc)}"
        finally:
            self.lap("write")


class _Status(NamedTuple):
    """What one rank tells the others after applying fn to its block."""

    error: object  # None, or what went wrong
    rows: int = 0
    in_crc: int = 0
    row_shape: tuple = ()
    dtype: str = ""
    out_crc: int = 0
    seconds: float = 0.0


def _process(fn, part):
    """Apply fn to this rank's block; return the output and a status for everyone."""
    received = _crc(part)
    t = time.perf_counter()
    try:
        out = _as_numpy(fn(part))
        if out.ndim == 0 or out.shape[0] != part.shape[0]:
            raise PipelineValueError(f"fn returned shape {tuple(out.shape)} for a block of {part.shape[0]} rows; "
                                     "it must return one row per input row")
        out = np.ascontiguousarray(out)
    except Exception as exc:
        return None, _Status(_describe(exc))
    seconds = time.perf_counter() - t
    return out, _Status(None, part.shape[0], received, out.shape[1:], str(out.dtype), _crc(out), seconds)


def pipeline(fn, source, *, output=None, chunk_rows=None, verify=False, progress=None, comm=None, root=0):
    """Scatter the rows of source from root, apply fn on every rank, gather the results to root.

    fn(block) -> array with one row per row of block (a numpy array or a
    torch tensor; every rank's must agree in dtype and row shape). It
    also gets empty blocks, when a round has fewer rows than ranks.

    source (used on root only): an array, a path, a source object, or a
    callable returning one of these. output: None to return the results
    as one array, a .npy path (written as it goes, renamed into place
    when complete), or a callable(start_row, block). chunk_rows: rows per
    round (default: all at once). verify: recompute each round serially
    on root and compare bitwise. progress: True for a bar on stderr, or
    a callable(done_rows, total_rows).

    Returns a :class:`Result` on root and None on other ranks. Raises
    PipelineError on every rank if anything fails on any rank.
    """
    comm = _comm(comm)
    lap = Laps()
    boss = _Root(comm, fn, verify, lap) if comm.rank == root else None
    plan = comm.broadcast_object(boss and boss.open(source, output, chunk_rows, progress), root)
    if plan[0] == "error":
        raise PipelineError(f"pipeline: on rank {root}: {plan[1]}")
    _, rows, chunk = plan
    bounds = [(a, min(a + chunk, rows)) for a in range(0, rows, chunk)] or [(0, 0)]

    rank_rows, rank_secs = [0] * comm.size, [0.0] * comm.size
    try:
        for a, b in bounds:
            parts = boss and boss.load(a, b)
            _raise_pending(comm.broadcast_object(boss and boss.pending, root), root)
            part = comm.scatter(parts, root)
            lap("scatter")
            out, status = _process(fn, part)
            statuses = comm.all_gather_object(status)
            lap("process")
            _check_statuses(statuses, a, b, comm.size)
            for r, s in enumerate(statuses):
                rank_rows[r] += s.rows
                rank_secs[r] += s.seconds
            got = comm.gather(out, root)
            lap("gather")
            if boss:
                boss.receive(a, b, statuses, got)
    except BaseException:
        if boss:  # a failed round: no half-written output left behind, no file left open
            boss.sink.close(False, None)
        raise

    written = boss and boss.close(rows)
    _raise_pending(comm.broadcast_object(boss and boss.pending, root), root)
    if not boss:
        return None
    return Result(
        rows=rows,
        rows_out=boss.rows_out,
        ranks=comm.size,
        backend=comm.backend,
        rounds=len(bounds),
        chunk_rows=chunk,
        row_shape=tuple(boss.empty.shape[1:]),
        dtype=str(boss.empty.dtype),
        timings=lap.timings(),
        total_s=lap.total(),
        checksum=boss.out_crc,
        input_checksum=boss.in_crc,
        rows_per_rank=rank_rows,
        process_per_rank=rank_secs,
        output=written,
        verified=(boss.mismatched == 0) if verify else None,
        mismatched_rows=boss.mismatched,
        first_mismatch=boss.first_bad,
    )


def _raise_pending(message, root):
    if message is not None:
        raise PipelineError(f"pipeline: on rank {root}: {message}")


def _check_statuses(statuses, a, b, size):
    """Raise the same error on every rank if fn failed or disagreed anywhere."""
    failed = [(r, s.error) for r, s in enumerate(statuses) if s.error is not None]
    if failed:
        r, msg = failed[0]
        more = f" (and on {len(failed) - 1} more ranks)" if len(failed) > 1 else ""
        raise PipelineError(f"pipeline: fn failed on rank {r} of {size}, rows {a} to {b}: {msg}{more}")
    if len({(s.row_shape, s.dtype) for s in statuses}) > 1:
        listing = "; ".join(f"rank {r}: {s.dtype} rows of shape {s.row_shape}" for r, s in enumerate(statuses))
        raise PipelineError(f"pipeline: fn must return the same dtype and row shape on every rank; got {listing}")


def _differing_rows(got, expect):
    """Return the indices of rows whose bytes differ (every row, if the shapes differ)."""
    if got.shape != expect.shape or got.dtype != expect.dtype:
        return np.arange(max(got.shape[0], expect.shape[0] if expect.ndim else 1))
    n = got.shape[0]
    if n == 0:
        return np.arange(0)
    g = got.reshape(n, -1).view(np.uint8) if got.ndim > 1 else got.reshape(n, 1).view(np.uint8)
    e = expect.reshape(n, -1).view(np.uint8) if expect.ndim > 1 else expect.reshape(n, 1).view(np.uint8)
    return np.flatnonzero((g != e).any(axis=1))
