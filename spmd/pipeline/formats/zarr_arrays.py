"""Zarr (zarr-python 3; stores of format 3 and 2): an array in a directory store, rows along axis 0.

:class:`ZarrSource` is opened by every rank, which reads its own rows;
shares end on its chunks' edges (:meth:`ZarrSource.grid`), so no chunk
is decoded twice.  ``store.zarr`` names an array; ``store.zarr:/group/name``
one array of a group.  :class:`ZarrStore` is an output whose chunks are
written by the ranks that own them.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path
from typing import Any, NamedTuple, Optional

import numpy as np

from spmd.errors import PipelineError, PipelineValueError, SourceError
from spmd.pipeline.formats.extra import need
from spmd.pipeline.formats.names import is_zarr, split_array
from spmd.pipeline.grid import Grid
from spmd.pipeline.sinks import check_output, partial_path
from spmd.util.atomic import fsync_dir, temporary_name

__all__ = ["ZarrSource", "ZarrStore", "ZarrRows", "ZarrTicket", "split_array", "is_zarr", "arrays_in",
           "CHUNK_BYTES", "MIN_CHUNK_BYTES", "MAX_LIKE_BYTES"]


def arrays_in(group: Any) -> list[str]:
    """The paths of every array under a group."""
    zarr = need("zarr", "reading Zarr")
    return sorted("/" + k for k, v in group.members(max_depth=None) if isinstance(v, zarr.Array))


class ZarrSource:
    """Rows of a Zarr array (any number of dimensions, rows along axis 0)."""

    every_rank = True

    def __init__(self, spec: Any, name: Optional[str] = None) -> None:
        zarr = need("zarr", "reading Zarr")
        self.store, self.name = split_array(spec, name)
        if not Path(self.store).is_dir():
            raise SourceError(f"{self.store}: no such Zarr store (a directory)")
        try:
            found = zarr.open(store=self.store, mode="r", path=self.name or "")
        except Exception as exc:
            raise SourceError(f"{self.store}{':/' + self.name if self.name else ''}: not a readable Zarr array "
                              f"({type(exc).__name__}: {exc})") from None
        if not isinstance(found, zarr.Array):
            inside = arrays_in(found)
            raise SourceError(f"{self.store}{':/' + self.name if self.name else ''} is a group, not an array; "
                              f"its arrays are {', '.join(inside) or 'none'}: name one, {self.store}:/NAME")
        self._array = found
        if found.dtype.kind not in "biuf":
            raise SourceError(f"{self.store}: holds {found.dtype} values, not numbers; the pipeline reads numeric "
                              "arrays (integers, floats, booleans)")
        if found.ndim == 0:
            raise SourceError(f"{self.store}: a 0-d array; the pipeline needs rows")
        self.shape, self.dtype = tuple(found.shape), np.dtype(found.dtype)
        self.chunks = tuple(found.chunks)
        self.format = found.metadata.zarr_format

    def grid(self) -> Grid:
        """The array's chunk rows: a share edge there decodes no chunk twice."""
        return Grid.of(self.chunks[0], why=f"the input's Zarr chunks of {self.chunks[0]} rows")

    def read(self, start: int, stop: int) -> np.ndarray:
        """Return rows start to stop (exclusive)."""
        stop = min(stop, self.shape[0])
        if stop <= start:
            return np.empty((0,) + self.shape[1:], self.dtype)
        try:
            rows = np.asarray(self._array[start:stop])
        except Exception as exc:
            raise SourceError(f"{self.store}: rows {start} to {stop} cannot be read ({type(exc).__name__}: "
                              f"{exc}); is a chunk damaged or missing?") from None
        return rows

    def identity(self) -> str:
        """The array's format, shape, dtype, chunks and codecs (its metadata, no rows read)."""
        meta = self._array.metadata
        codecs = getattr(meta, "codecs", None) or (getattr(meta, "compressor", None), getattr(meta, "filters", None))
        return (f"zarr v{self.format} {Path(self.store).name}{':/' + self.name if self.name else ''} {self.shape} "
                f"{self.dtype} chunks {self.chunks} codecs {codecs}")

    def __reduce__(self) -> tuple[type, tuple[str, Optional[str]]]:
        return (type(self), (self.store, self.name))

    def __repr__(self) -> str:
        return f"<ZarrSource {self.store}{':/' + self.name if self.name else ''} {self.shape} {self.dtype}>"


#: An output's chunk holds the input's chunk rows (Zarr, HDF5 chunks or Parquet row groups, evenly spaced),
#: else a sixteenth of the rows, but at least MIN_CHUNK_BYTES and at most CHUNK_BYTES of input rows (whole
#: rows; set by the input alone, so the store's chunking, and with it its bytes, are the same at every
#: world size, chunk_rows and balance).
CHUNK_BYTES = 4 << 20
MIN_CHUNK_BYTES = 64 << 10
#: A chunked input's chunks are kept by a Zarr output up to this many bytes of input rows a chunk.
MAX_LIKE_BYTES = 64 << 20
#: The file in a store being written that holds root's mark (removed before the store is put in place).
MARK = ".spmd-mark"


def place_dir(tmp: str, path: Path) -> None:
    """Put the directory tmp at path, replacing what is there (the old one removed after the rename)."""
    old = None
    if path.exists():
        old = temporary_name(path) + "-old"
        os.replace(path, old)
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(os.path.abspath(path)))
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


class ZarrRows:
    """Write rows into a Zarr array (any rank: whole chunks of its own, which no other rank touches)."""

    def __init__(self, array: Any) -> None:
        self.array = array

    def write(self, start: int, block: np.ndarray) -> None:
        if block.shape[0]:
            self.array[start : start + block.shape[0]] = block

    def sync(self) -> None:
        """zarr has written each chunk to its file when the assignment returns."""

    def close(self, sync: bool = True) -> None:
        """Nothing stays open between writes."""


class ZarrTicket(NamedTuple):
    """What a rank needs to write its chunks into root's store: where it is, and root's mark in it."""

    where: str
    nonce: bytes

    def open(self) -> ZarrRows:
        """Open the array and check it is root's store (the mark); return its writer."""
        zarr = need("zarr", "writing Zarr")
        try:
            seen = (Path(self.where) / MARK).read_bytes()
        except OSError:
            seen = b""
        if seen != self.nonce:
            raise PipelineError(f"{self.where} here is not the store root made (no file system shared with it)")
        return ZarrRows(zarr.open_array(store=self.where, mode="r+"))


class ZarrStore:
    """A Zarr output (format 3, zarr's default codecs): a new directory store of one array, rows along axis 0.

    Its chunks hold ``chunk_rows`` rows (default: the input's chunks, or a
    sixteenth of the rows, 64 KiB to 4 MiB of input rows), and the pipeline
    ends every share and round on a chunk's edge (:meth:`grid`), so each
    chunk is written whole by the one rank whose rows it holds, in
    parallel (root alone with verify or write='root').  It is filled in
    a temporary directory (``<out>.partial`` when resumable) and put in
    place when complete.
    """

    positional = True
    parallel = True
    threaded = True

    def __init__(self, path: Any, rows: int, resume: bool = False, chunk_rows: Optional[int] = None) -> None:
        check_output(path)  # its directory exists and is writable; it is not a directory other than a store
        if chunk_rows is not None and (isinstance(chunk_rows, bool) or not isinstance(chunk_rows, int)
                                       or chunk_rows < 1):
            raise PipelineValueError(f"output {path}: chunk_rows={chunk_rows!r}; give the rows of a chunk, "
                                     "a whole number of at least 1")
        self.given_chunk = chunk_rows
        self.path, self.rows, self.resume = Path(path), int(rows), resume
        self.partial = partial_path(self.path) if resume else None
        self.writer: Optional[ZarrRows] = None
        self.where: Optional[str] = None
        self.dtype: Any = None
        self.row_shape: tuple = ()
        self.row_bytes = 0
        self.chunk_rows = max(1, self.rows)

    def grid(self, in_row_bytes: int, like: Optional[Grid] = None) -> Grid:
        """The store's chunk rows: chunk_rows if given, else the input's chunks (like) where evenly spaced
        and at most MAX_LIKE_BYTES of input rows, else a sixteenth of the rows within MIN_CHUNK_BYTES and
        CHUNK_BYTES of input rows; every share and round ends on them."""
        row = max(int(in_row_bytes), 1)
        if self.given_chunk:
            rows = self.given_chunk
        elif like is not None and not like.edges and 1 < like.step and like.step * row <= MAX_LIKE_BYTES:
            rows = like.step
        else:
            rows = min(CHUNK_BYTES // row, max(MIN_CHUNK_BYTES // row, -(-self.rows // 16)))
        self.chunk_rows = max(1, min(self.rows, rows))
        return Grid.of(self.chunk_rows, why=f"the output's Zarr chunks of {self.chunk_rows} rows")

    def _layout(self, dtype: Any, row_shape: tuple) -> tuple:
        self.dtype, self.row_shape = np.dtype(dtype), tuple(int(n) for n in row_shape)
        self.row_bytes = self.dtype.itemsize * int(np.prod(self.row_shape, dtype=np.int64))
        return (self.chunk_rows,) + self.row_shape

    def create(self, dtype: Any, row_shape: tuple) -> str:
        """Make the store and its array, whole-sized (no chunk written yet)."""
        zarr = need("zarr", "writing Zarr")
        chunks = self._layout(dtype, row_shape)
        self.where = os.fspath(self.partial) if self.resume else temporary_name(self.path)
        if self.resume and Path(self.where).exists():
            shutil.rmtree(self.where)
        self.writer = ZarrRows(zarr.create_array(store=self.where, shape=(self.rows,) + self.row_shape,
                                                 chunks=chunks, dtype=self.dtype, fill_value=0, zarr_format=3))
        return self.where

    def reopen(self, dtype: Any, row_shape: tuple) -> str:
        """Open a resumed run's ``.partial`` store after checking its array."""
        zarr = need("zarr", "writing Zarr")
        chunks = self._layout(dtype, row_shape)
        try:
            arr = zarr.open_array(store=os.fspath(self.partial), mode="r+")
        except Exception as exc:
            raise PipelineError(f"{self.partial} cannot be opened ({type(exc).__name__}: {exc}); the journal "
                                f"{self.path}.journal belongs to it: delete both to start over") from None
        if (tuple(arr.shape), np.dtype(arr.dtype), tuple(arr.chunks)) != ((self.rows,) + self.row_shape,
                                                                          self.dtype, chunks):
            raise PipelineError(f"{self.partial} is not the output the journal describes ({arr.dtype} "
                                f"{arr.shape} in chunks {arr.chunks}); delete it and {self.path}.journal to start over")
        self.writer, self.where = ZarrRows(arr), os.fspath(self.partial)
        return self.where

    def ticket(self, start: int) -> ZarrTicket:
        """Mark the store (a file beside its array's) and return what another rank opens it with."""
        nonce = np.random.bytes(8)
        with open(Path(os.fspath(self.where)) / MARK, "wb") as f:
            f.write(nonce)
        return ZarrTicket(os.fspath(self.where), nonce)

    def read_rows(self, start: int, stop: int) -> np.ndarray:
        """Return rows start to stop as stored (a resumed run checks them)."""
        assert self.writer is not None
        return np.asarray(self.writer.array[start:stop])

    def __call__(self, start: int, block: np.ndarray) -> None:
        if self.writer is None:
            self.create(block.dtype, block.shape[1:])
        assert self.writer is not None
        self.writer.write(start, block)

    def sync(self) -> None:
        """zarr has written every chunk of the round to its file when the assignment returns."""

    def close(self, ok: bool, empty: Any) -> Optional[Path]:
        """Put the store in place (ok) or remove it (a plain run) / keep it (resumable); return the path."""
        if ok and self.writer is None:
            self.create(empty.dtype, empty.shape[1:])
        if self.where is None:
            return None
        if not ok:
            if not self.resume:
                shutil.rmtree(self.where, ignore_errors=True)
            return None
        with contextlib.suppress(FileNotFoundError):
            os.remove(Path(self.where) / MARK)
        place_dir(self.where, self.path)
        self.where = None
        return self.path
