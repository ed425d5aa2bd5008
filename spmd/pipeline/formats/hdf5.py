"""HDF5 (h5py): one dataset of a file, ``path.h5:/group/dataset``, rows along its first axis.

:class:`Hdf5Source` is opened read-only by every rank (HDF5's file
locking off: readers do not need it, and it fails on some shared file
systems); each rank reads its own rows, chunked or contiguous alike.
:class:`Hdf5File` is an output every rank writes at byte offsets, as
a .npy one.
"""

from __future__ import annotations

import os
from typing import Any, Optional

import numpy as np

from spmd.errors import PipelineError, SourceError
from spmd.pipeline.formats.extra import need
from spmd.pipeline.formats.names import HDF5 as SUFFIXES
from spmd.pipeline.formats.names import split_dataset
from spmd.pipeline.grid import ANY_ROW, Grid
from spmd.pipeline.sinks import NpyFile, RowWriter
from spmd.util.atomic import AtomicFile

__all__ = ["Hdf5Source", "Hdf5File", "split_dataset", "datasets", "SUFFIXES"]

def datasets(h5: Any) -> list[str]:
    """The paths of every dataset in an open file, in the file's order."""
    h5py = need("h5py", "reading HDF5")
    found: list[str] = []
    h5.visititems(lambda name, obj: found.append("/" + name) if isinstance(obj, h5py.Dataset) else None)
    return found


class Hdf5Source:
    """Rows of one HDF5 dataset (any number of dimensions, rows along axis 0).

    dataset: its path in the file; may be left out when the file holds
    exactly one dataset.
    """

    every_rank = True

    def __init__(self, spec: Any, dataset: Optional[str] = None) -> None:
        h5py = need("h5py", "reading HDF5")
        self.path, name = split_dataset(spec, dataset)
        if not self.path.is_file():
            raise SourceError(f"{self.path}: no such HDF5 file")
        try:
            self._file = h5py.File(self.path, "r", locking=False)
        except OSError as exc:
            raise SourceError(f"{self.path}: not a readable HDF5 file ({exc}); was it copied completely?") from None
        present = datasets(self._file)
        if name is None:
            if len(present) != 1:
                raise SourceError(f"{self.path} holds {len(present)} datasets ({', '.join(present) or 'none'}); "
                                  f"name one: {self.path}:/NAME (--dataset /NAME)")
            name = present[0]
        obj = self._file.get(name)
        if not isinstance(obj, h5py.Dataset):
            what = "a group" if obj is not None else "nothing"
            raise SourceError(f"{self.path}: {name} is {what}, not a dataset; its datasets are "
                              f"{', '.join(present) or 'none'}")
        self.dataset, self._ds = name, obj
        if obj.dtype.kind not in "biuf":
            raise SourceError(f"{self.path}:{name} holds {obj.dtype} values, not numbers; the pipeline reads "
                              "numeric datasets (integers, floats, booleans)")
        if obj.ndim == 0:
            raise SourceError(f"{self.path}:{name} is a scalar; the pipeline needs rows (a dataset of 1 or more "
                              "dimensions)")
        self.shape, self.dtype, self.chunks = tuple(obj.shape), np.dtype(obj.dtype), obj.chunks

    def grid(self) -> Grid:
        """A chunked dataset's chunk rows (a contiguous one: any row)."""
        if not self.chunks or self.chunks[0] <= 1:
            return ANY_ROW
        return Grid.of(self.chunks[0], why=f"the input's HDF5 chunks of {self.chunks[0]} rows")

    def read(self, start: int, stop: int) -> np.ndarray:
        """Return rows start to stop (exclusive)."""
        stop = min(stop, self.shape[0])
        if stop <= start:
            return np.empty((0,) + self.shape[1:], self.dtype)
        try:
            rows: np.ndarray = self._ds[start:stop]
        except OSError as exc:
            raise SourceError(f"{self.path}:{self.dataset}: rows {start} to {stop} cannot be read ({exc}); "
                              "is the file damaged or truncated?") from None
        return rows

    def identity(self) -> str:
        """The dataset's path, shape, dtype, chunking and filters, and the file's size."""
        ds = self._ds
        return (f"hdf5 {self.path.name}:{self.dataset} {self.shape} {self.dtype} chunks {self.chunks} "
                f"compression {ds.compression} {ds.compression_opts} size {self.path.stat().st_size}")

    def __reduce__(self) -> tuple[type, tuple[str, str]]:
        return (type(self), (os.fspath(self.path), self.dataset))

    def __repr__(self) -> str:
        return f"<Hdf5Source {self.path}:{self.dataset} {self.shape} {self.dtype}>"


def _make(where: str, name: str, rows: int, dtype: Any, row_shape: tuple) -> int:
    """Make where an HDF5 file of one contiguous dataset, allocated whole; return its data's byte offset."""
    h5py = need("h5py", "writing HDF5")
    parent, _, base = name.strip("/").rpartition("/")
    with h5py.File(where, "w", locking=False) as f:
        group = f.require_group(parent) if parent else f
        dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
        dcpl.set_alloc_time(h5py.h5d.ALLOC_TIME_EARLY)  # its place in the file fixed now: ranks write there
        dcpl.set_fill_time(h5py.h5d.FILL_TIME_NEVER)  # every row is written later
        dcpl.set_obj_track_times(False)  # no clock in the file: the same rows make the same bytes
        space = h5py.h5s.create_simple((int(rows),) + tuple(int(n) for n in row_shape))
        dsid = h5py.h5d.create(group.id, base.encode(), h5py.h5t.py_create(np.dtype(dtype)), space, dcpl=dcpl)
        offset = dsid.get_offset()
    size = os.path.getsize(where)
    if offset is None:  # nothing to store (0 rows)
        return size
    need_bytes = offset + int(rows) * np.dtype(dtype).itemsize * int(np.prod(row_shape, dtype=np.int64))
    if size < need_bytes:
        os.truncate(where, need_bytes)
    return int(offset)


def _offset(where: str, name: str, rows: int, dtype: Any, row_shape: tuple) -> int:
    """The data offset of an existing output's dataset, after checking it is the one described."""
    h5py = need("h5py", "writing HDF5")
    with h5py.File(where, "r", locking=False) as f:
        ds = f.get(name)
        want = ((int(rows),) + tuple(row_shape), np.dtype(dtype))
        if not isinstance(ds, h5py.Dataset) or (tuple(ds.shape), ds.dtype) != want or ds.chunks is not None:
            raise SourceError(f"{where}: {name} is not a contiguous {want[1]} dataset of shape {want[0]}")
        offset = ds.id.get_offset()
    return os.path.getsize(where) if offset is None else int(offset)


class Hdf5File(NpyFile):
    """An HDF5 output, ``out.h5:/dataset`` (default ``/data``): a new file of one contiguous dataset.

    Made whole-sized first, like a .npy output, so every rank writes its
    rows at their byte offsets in the dataset (HDF5's library is not
    involved after that: h5py without MPI allows no concurrent writers);
    put in place only when complete.  The file holds no timestamps: the
    same rows give the same bytes at every world size.
    """

    def __init__(self, spec: Any, rows: int, resume: bool = False) -> None:
        path, name = split_dataset(spec)
        super().__init__(path, rows, resume)
        self.dataset = name or "/data"

    def _layout(self, dtype: Any, row_shape: tuple) -> bytes:
        self.dtype, self.row_shape = np.dtype(dtype), tuple(row_shape)
        self.row_bytes = self.dtype.itemsize * int(np.prod(self.row_shape, dtype=np.int64))
        return b""

    def create(self, dtype: Any, row_shape: tuple) -> str:
        """Make the file, its dataset allocated whole; return its path for the writers."""
        self._layout(dtype, row_shape)
        if self.resume:
            self.where = os.fspath(self.partial)
        else:
            self.atomic = AtomicFile(self.path)
            self.where = self.atomic.tmp
        self.header_bytes = _make(self.where, self.dataset, self.rows, self.dtype, self.row_shape)
        self.writer = RowWriter(self.where, self.header_bytes, self.row_bytes)
        return self.where

    def reopen(self, dtype: Any, row_shape: tuple) -> str:
        """Open a resumed run's ``.partial`` after checking its dataset's shape and dtype."""
        self._layout(dtype, row_shape)
        if not self.partial.exists():
            raise PipelineError(f"{self.partial} is missing: the journal {self.path}.journal belongs to it; "
                                "delete the journal to start over")
        try:
            self.header_bytes = _offset(os.fspath(self.partial), self.dataset, self.rows, self.dtype,
                                        self.row_shape)
        except (OSError, SourceError) as exc:
            raise PipelineError(f"{self.partial} is not the output the journal describes ({exc}); delete it and "
                                f"{self.path}.journal to start over") from None
        self.where = os.fspath(self.partial)
        self.writer = RowWriter(self.where, self.header_bytes, self.row_bytes)
        return self.where
