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

import os
import sys
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np

from .comms.arrays import is_tensor, split_sizes
from .errors import PipelineError
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

#: Phases timed on root, in the order they happen within a round.
PHASES = ("load", "scatter", "process", "gather", "check", "write", "verify")


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


# -- sinks: where root puts the results --------------------------------------------------


class _Collect:
    def __init__(self):
        self.parts = []

    def __call__(self, start, block):
        self.parts.append(block)

    def close(self, ok, empty):
        if not ok:
            return None
        return np.concatenate(self.parts) if self.parts else empty


class _NpyWriter:
    """Write a .npy file block by block; it appears under its name only when complete."""

    def __init__(self, path, rows):
        self.path, self.rows = Path(path), rows
        self.tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        self.file = None

    def __call__(self, start, block):
        if self.file is None:
            self.file = open(self.tmp, "wb")
            header = {
                "descr": np.lib.format.dtype_to_descr(block.dtype),
                "fortran_order": False,
                "shape": (self.rows,) + block.shape[1:],
            }
            np.lib.format.write_array_header_2_0(self.file, header)
        self.file.write(np.ascontiguousarray(block).data)

    def close(self, ok, empty):
        if ok and self.file is None:
            self(0, empty)
        if self.file is not None:
            self.file.close()
        if ok:
            os.replace(self.tmp, self.path)
            return self.path
        self.tmp.unlink(missing_ok=True)
        return None


class _Call:
    def __init__(self, fn):
        self.fn = fn

    def __call__(self, start, block):
        self.fn(start, block)

    def close(self, ok, empty):
        return None


def _sink(output, rows):
    if output is None:
        return _Collect()
    if isinstance(output, (str, os.PathLike)):
        return _NpyWriter(output, rows)
    if callable(output):
        return _Call(output)
    raise TypeError(f"output must be None, a .npy path or a callable(start, block), got {type(output).__name__}")


class _Bar:
    """A one-line progress bar on stderr, redrawn at most every 0.2 s."""

    def __init__(self, stream=None):
        self.stream, self.t0, self.last = stream or sys.stderr, time.perf_counter(), 0.0

    def __call__(self, done, total):
        now = time.perf_counter()
        if done < total and now - self.last < 0.2:
            return
        self.last = now
        frac = done / total if total else 1.0
        bar = "#" * int(30 * frac)
        self.stream.write(f"\r[{bar:<30}] {frac:4.0%} {done}/{total} rows {now - self.t0:.1f} s")
        if done >= total:
            self.stream.write("\n")
        self.stream.flush()


# -- the pipeline ----------------------------------------------------------------------


def _crc(a, start=0):
    """Return the CRC-32 of a's bytes in C order, continuing from start."""
    return zlib.crc32(np.ascontiguousarray(a).reshape(-1).view(np.uint8), start)


def _as_numpy(x):
    if is_tensor(x):
        return x.detach().cpu().numpy()
    if not isinstance(x, np.ndarray):
        raise TypeError(f"fn must return a numpy array or a torch tensor, got {type(x).__name__}")
    return x


@dataclass
class Result:
    """What a pipeline run did, on root."""

    rows: int
    rows_out: int
    ranks: int
    backend: str
    rounds: int
    chunk_rows: int
    row_shape: tuple
    dtype: str
    #: Seconds on root per phase (see PHASES); process is wall time until the slowest rank is done.
    timings: dict
    total_s: float
    #: CRC-32 of the output data in row order (C order, no .npy header).
    checksum: int
    input_checksum: int
    rows_per_rank: list
    process_per_rank: list
    #: The output array (output=None), the .npy path written, or None for a callable.
    output: object = None
    #: True or False after verify=True, else None.
    verified: object = None
    mismatched_rows: int = 0
    first_mismatch: object = None

    @property
    def rows_per_second(self):
        return self.rows / self.total_s if self.total_s > 0 else float("inf")

    def summary(self):
        """Return a few lines for people: sizes, phases, throughput, checksum."""
        each = f"{'x'.join(map(str, self.row_shape))} {self.dtype}" if self.row_shape else self.dtype
        phases = ", ".join(f"{p} {self.timings[p]:.3f}" for p in PHASES if p in self.timings)
        lines = [
            f"{self.rows} rows in, {self.rows_out} out ({each} each); "
            f"{_plural(self.ranks, 'rank')}, backend {self.backend}; "
            f"{_plural(self.rounds, 'round')} of up to {self.chunk_rows} rows",
            f"seconds: {phases}; total {self.total_s:.3f}",
            f"{self.rows_per_second:,.0f} rows/s; processing per rank: slowest "
            f"{max(self.process_per_rank):.3f} s, fastest {min(self.process_per_rank):.3f} s",
            f"checksum crc32 {self.checksum:08x} (input {self.input_checksum:08x})",
        ]
        if self.verified is not None:
            lines.append(
                "verify: serial recomputation identical"
                if self.verified
                else f"verify: FAILED, {self.mismatched_rows} rows differ (first: row {self.first_mismatch})"
            )
        return "\n".join(lines)


def _plural(n, word):
    return f"{n} {word}{'s' * (n != 1)}"


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
                raise ValueError(f"chunk_rows must be at least 1, got {chunk_rows}")
            self.sink = _sink(output, rows)
            self.bar = _Bar() if progress is True else progress or None
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
                raise ValueError(f"reading rows {a} to {b} gave shape {block.shape}")
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
            raise ValueError(f"fn returned shape {tuple(out.shape)} for a block of {part.shape[0]} rows; "
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
    started = time.perf_counter()
    times = dict.fromkeys(PHASES, 0.0)
    clock = [started]

    def lap(phase):
        now = time.perf_counter()
        times[phase] += now - clock[0]
        clock[0] = now

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
        timings={p: v for p, v in times.items() if v or p != "verify"},
        total_s=time.perf_counter() - started,
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
