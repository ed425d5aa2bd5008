"""Where a pipeline's results go: an array in memory, a .npy file, or a callable (chosen by .outputs).

A .npy output (:class:`NpyFile`) is made whole-sized, with its header, as
soon as the first round tells the output's dtype and row shape, and rows
are written at their offsets, by root or by each rank itself
(:class:`RowWriter`). It appears under its name only when complete: a
plain run writes a temporary of :mod:`spmd.util.atomic`, a resumable one
``<output>.partial``, kept after a crash for the next run to continue.
"""

import contextlib
import os
from pathlib import Path
from typing import NamedTuple

import numpy as np

from spmd.pipeline.formats.names import has_metadata, split_dataset
from spmd.util.atomic import AtomicFile, fsync_dir
from spmd.errors import PipelineError, PipelineValueError

__all__ = ["check_output", "Collect", "NpyFile", "RowWriter", "RowsTicket", "Call", "partial_path"]


class Collect:
    """Keep the blocks in memory; close returns them as one array."""

    positional = False
    threaded = True  # root's writer thread may take the rounds (a user's callable: the main thread)

    def __init__(self):
        self.parts = []

    def __call__(self, start, block):
        self.parts.append(block)

    def close(self, ok, empty):
        if not ok:
            return None
        return np.concatenate(self.parts) if self.parts else empty


class Call:
    """Hand every block to fn(start_row, block); close returns None."""

    positional = False

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, start, block):
        self.fn(start, block)

    def close(self, ok, empty):
        return None


def partial_path(path):
    """Where a resumable run keeps its unfinished output."""
    return Path(f"{os.fspath(path)}.partial")


def _header(dtype, row_shape, rows):
    """The bytes of a .npy (format 2.0) header for rows rows of row_shape in dtype."""
    import io

    buf = io.BytesIO()
    np.lib.format.write_array_header_2_0(buf, {
        "descr": np.lib.format.dtype_to_descr(np.dtype(dtype)),
        "fortran_order": False,
        "shape": (int(rows),) + tuple(int(n) for n in row_shape),
    })
    return buf.getvalue()


class RowWriter:
    """Write rows of a .npy file at their offsets (any rank; the file exists, whole-sized)."""

    def __init__(self, path, header_bytes, row_bytes):
        self.path, self.header_bytes, self.row_bytes = os.fspath(path), header_bytes, row_bytes
        self.fd = os.open(self.path, os.O_WRONLY)

    def write(self, start, block):
        """Write block's rows from row start on; return the bytes written."""
        data = memoryview(np.ascontiguousarray(block).reshape(-1).view(np.uint8))
        offset, done = self.header_bytes + start * self.row_bytes, 0
        while done < len(data):
            done += os.pwrite(self.fd, data[done:], offset + done)
        return done

    def write_bytes(self, offset, data):
        """Write raw bytes at a byte offset (root's mark that ranks look for)."""
        data = memoryview(np.ascontiguousarray(data).reshape(-1).view(np.uint8))
        done = 0
        while done < len(data):
            done += os.pwrite(self.fd, data[done:], offset + done)

    def read_bytes(self, offset, count):
        """Read count bytes at a byte offset through a separate descriptor."""
        fd = os.open(self.path, os.O_RDONLY)
        try:
            return os.pread(fd, count, offset)
        finally:
            os.close(fd)

    def sync(self):
        os.fdatasync(self.fd)

    def close(self, sync=True):
        if self.fd is None:
            return
        try:
            if sync:
                os.fsync(self.fd)
        finally:
            os.close(self.fd)
            self.fd = None


class RowsTicket(NamedTuple):
    """What a rank needs to write its rows into root's .npy (or HDF5) file: where, and root's mark."""

    where: str
    header_bytes: int
    row_bytes: int
    nonce: bytes
    start: int

    def open(self):
        """Open the file and check it is root's (its mark at row start); return a RowWriter."""
        writer = RowWriter(self.where, self.header_bytes, self.row_bytes)
        try:
            at = self.header_bytes + self.start * self.row_bytes
            if self.nonce and writer.read_bytes(at, len(self.nonce)) != self.nonce:
                raise PipelineError(f"{self.where} here is not the file root made (no file system shared with it)")
        except Exception:
            writer.close(sync=False)
            raise
        return writer


class NpyFile:
    """A .npy output of rows rows, written at row offsets, put in place whole.

    resume: the file is ``<path>.partial`` (kept on failure, reopened by
    the next run) rather than a temporary removed on failure.
    """

    positional = True
    threaded = True

    def __init__(self, path, rows, resume=False):
        check_output(path)
        self.path, self.rows, self.resume = Path(path), int(rows), resume
        self.partial = partial_path(self.path) if resume else None
        self.atomic = self.writer = None
        self.where = None  # the file ranks write into, once created
        self.dtype = self.row_shape = None
        self.header_bytes = self.row_bytes = None

    def _layout(self, dtype, row_shape):
        self.dtype, self.row_shape = np.dtype(dtype), tuple(row_shape)
        self.row_bytes = self.dtype.itemsize * int(np.prod(self.row_shape, dtype=np.int64))
        header = _header(self.dtype, self.row_shape, self.rows)
        self.header_bytes = len(header)
        return header

    def create(self, dtype, row_shape):
        """Make the file, whole-sized with its header; return its path for the writers."""
        header = self._layout(dtype, row_shape)
        if self.resume:
            f = open(self.partial, "wb")
            self.where = os.fspath(self.partial)
        else:
            self.atomic = AtomicFile(self.path)
            f = self.atomic.file
            self.where = self.atomic.tmp
        f.write(header)
        f.truncate(self.header_bytes + self.rows * self.row_bytes)
        f.flush()
        if self.resume:
            os.fsync(f.fileno())
            f.close()
        self.writer = RowWriter(self.where, self.header_bytes, self.row_bytes)
        return self.where

    def reopen(self, dtype, row_shape):
        """Open an existing ``.partial`` of a resumed run after checking its header and size."""
        header = self._layout(dtype, row_shape)
        try:
            with open(self.partial, "rb") as f:
                head = f.read(len(header))
            size = os.path.getsize(self.partial)
        except FileNotFoundError:
            raise PipelineError(f"{self.partial} is missing: the journal {self.path}.journal "
                                "belongs to it; delete the journal to start over") from None
        want = self.header_bytes + self.rows * self.row_bytes
        if head != header or size != want:
            raise PipelineError(f"{self.partial} is not the output the journal describes ({size} bytes "
                                f"where {want} were expected, or another header); delete it and "
                                f"{self.path}.journal to start over")
        self.where = os.fspath(self.partial)
        self.writer = RowWriter(self.where, self.header_bytes, self.row_bytes)
        return self.where

    def ticket(self, start):
        """Mark the file where rank start's rows go and return what another rank opens it with."""
        nonce = b""
        if (self.rows - start) * self.row_bytes >= 8:  # where a rank that sees this file finds these bytes
            nonce = np.random.bytes(8)
            self.writer.write_bytes(self.header_bytes + start * self.row_bytes, np.frombuffer(nonce, np.uint8))
        return RowsTicket(self.where, self.header_bytes, self.row_bytes, nonce, start)

    def read_rows(self, start, stop):
        """Return rows start to stop as they are in the file (a resumed run checks them)."""
        count = (stop - start) * self.row_bytes
        with open(self.where, "rb") as f:
            f.seek(self.header_bytes + start * self.row_bytes)
            data = f.read(count)
        return np.frombuffer(data, self.dtype).reshape((stop - start,) + self.row_shape)

    def __call__(self, start, block):
        if self.writer is None:
            self.create(block.dtype, block.shape[1:])
        self.writer.write(start, block)

    def sync(self):
        if self.writer is not None:
            self.writer.sync()

    def close(self, ok, empty):
        """Put the file in place (ok) or remove it (a plain run) / keep it (resumable); return the path or None."""
        if ok and self.writer is None:
            self.create(empty.dtype, empty.shape[1:])
        if self.writer is None:
            return None
        if not ok:
            with contextlib.suppress(OSError):
                self.writer.close(sync=self.resume)
            if self.atomic is not None:
                self.atomic.discard()
            return None
        self.writer.close()
        if self.atomic is not None:
            self.atomic.commit()
        else:
            os.replace(self.partial, self.path)
            fsync_dir(os.path.dirname(os.path.abspath(self.path)))
        return self.path


def check_output(path):
    """Raise PipelineValueError, naming path, unless a file can be made there: checked before any input
    is read, so a mistyped directory is found at once, not after the first round's compute."""
    path = split_dataset(path)[0]  # file.h5:/dataset: the file
    where = path.parent
    if path.suffix == ".zarr" and path.exists():
        if not (path.is_dir() and has_metadata(path)):
            raise PipelineValueError(f"output {path}: exists and is not a Zarr store; a .zarr output replaces "
                                     "only a store: choose another name or remove it")
    elif path.is_dir():
        raise PipelineValueError(f"output {path}: is a directory; give a file name such as {path / 'out.npy'}")
    if not where.is_dir():
        raise PipelineValueError(f"output {path}: the directory {where} does not exist; create it "
                                 f"(mkdir -p {where}) or choose another output path")
    if not os.access(where, os.W_OK | os.X_OK):
        raise PipelineValueError(f"output {path}: the directory {where} is not writable by this user; "
                                 "choose another output path")
