"""Where a pipeline's root reads rows from: arrays, .npy, .csv, shard folders, synthetic tables, formats.

A source is any object with ``shape``, ``dtype`` and ``read(start, stop)``
returning rows ``start:stop`` as a numpy array; :func:`open_source` makes
one from an array or a path.

A source that every rank can read itself says so with ``every_rank =
True`` and must pickle to something that opens the same rows on
another rank (a path, a seed): the pipeline then sends it to every rank
and each reads its own rows, instead of root reading them all and
scattering them. Here that is :class:`NpySource`, :class:`ShardSource`
(on a file system every rank sees) and :class:`SyntheticTable`; an
array in root's memory and a .csv file (read line by line) are read by
root alone. :func:`fingerprint` identifies a source's content cheaply,
for a resume journal.
"""

from __future__ import annotations

import os
import re
import zlib
from pathlib import Path
from typing import IO, Any, Optional, Sequence, Union

import numpy as np

from spmd.comms.arrays import is_tensor
from spmd.errors import SourceError, SourceTypeError

#: What names a file or folder of rows.
PathLike = Union[str, "os.PathLike[str]"]

__all__ = ["open_source", "ArraySource", "NpySource", "ShardSource", "CsvSource", "SyntheticTable", "fingerprint"]


class ArraySource:
    """Rows of an array in memory."""

    every_rank = False

    def __init__(self, array: Any) -> None:
        if is_tensor(array):
            array = array.detach().cpu().numpy()
        array = np.asarray(array)
        if array.ndim == 0:
            raise SourceError("the input must have at least one dimension (rows), got a 0-d array")
        self.array, self.shape, self.dtype = array, array.shape, array.dtype

    def read(self, start: int, stop: int) -> np.ndarray:
        """Return rows start to stop (exclusive)."""
        rows: np.ndarray = self.array[start:stop]
        return rows

    def __repr__(self) -> str:
        return f"<ArraySource {self.shape} {self.dtype}>"


class NpySource:
    """Rows of a .npy file, memory-mapped: only the rows read are loaded."""

    every_rank = True

    def __init__(self, path: PathLike) -> None:
        self.path = Path(path)
        _check_npy(self.path)
        try:
            self._map = np.load(self.path, mmap_mode="r")
        except ValueError as exc:
            raise SourceError(f"{self.path}: cannot memory-map ({exc}); save plain numeric arrays") from None
        if self._map.ndim == 0:
            raise SourceError(f"{self.path}: holds a 0-d array; the input needs rows")
        self.shape, self.dtype = self._map.shape, self._map.dtype

    def read(self, start: int, stop: int) -> np.ndarray:
        """Return rows start to stop (exclusive), copied into memory."""
        return np.array(self._map[start:stop])

    def __reduce__(self) -> tuple[type, tuple[str]]:
        return (type(self), (os.fspath(self.path),))

    def __repr__(self) -> str:
        return f"<NpySource {self.path} {self.shape} {self.dtype}>"


def _check_npy(path: Path) -> None:
    """Raise SourceError, saying what is wrong and what to do, unless path is a whole .npy file of numbers."""
    from numpy.lib import format as npy

    size = path.stat().st_size
    if size == 0:
        raise SourceError(f"{path}: the file is empty (0 bytes): was it copied completely?")
    with open(path, "rb") as f:
        try:
            version = npy.read_magic(f)
        except ValueError:
            raise SourceError(f"{path}: not a .npy file (it does not begin with numpy's header); write it with "
                              "numpy.save, or give a .csv file or a directory of .npy shards") from None
        try:
            if version in ((1, 0), (2, 0)):
                read = npy.read_array_header_1_0 if version == (1, 0) else npy.read_array_header_2_0
                shape, _, dtype = read(f)
            else:  # 3.0 (utf-8 field names): numpy reads it only through a private function
                shape, _, dtype = getattr(npy, "_read_array_header")(f, version)
        except (ValueError, EOFError) as exc:
            raise SourceError(f"{path}: its .npy header is damaged ({exc}); was it copied completely?") from None
        offset = f.tell()
    if dtype.hasobject:
        raise SourceError(f"{path}: holds Python objects ({dtype}), which cannot be memory-mapped; "
                          "save plain numeric arrays")
    need = offset + int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if size < need:
        raise SourceError(f"{path}: the file is shorter than its header says: {size:,} bytes, but its "
                          f"{'x'.join(map(str, shape)) or 'scalar'} {dtype} array needs {need:,}: "
                          "was it copied completely?")


def _natural(name: str) -> list[int | str]:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


class ShardSource:
    """Rows of a directory of .npy shards, concatenated in natural name order
    (part2 before part10); shards must agree in dtype and row shape."""

    every_rank = True

    def __init__(self, directory: PathLike) -> None:
        self.directory = Path(directory)
        paths = sorted(self.directory.glob("*.npy"), key=lambda p: _natural(p.name))
        if not paths:
            raise SourceError(f"{self.directory}: no .npy shards in this directory")
        self.shards = [NpySource(p) for p in paths]
        first = self.shards[0]
        for s in self.shards[1:]:
            if s.dtype != first.dtype or s.shape[1:] != first.shape[1:]:
                raise SourceError(
                    f"{s.path.name} holds {s.dtype} rows of shape {s.shape[1:]} but "
                    f"{first.path.name} holds {first.dtype} rows of shape {first.shape[1:]}; "
                    "every shard must match"
                )
        self.starts = np.cumsum([0] + [s.shape[0] for s in self.shards])
        self.shape = (int(self.starts[-1]),) + first.shape[1:]
        self.dtype = first.dtype

    def read(self, start: int, stop: int) -> np.ndarray:
        """Return rows start to stop (exclusive), across shard boundaries."""
        pieces = []
        for s, lo, hi in zip(self.shards, self.starts[:-1], self.starts[1:]):
            a, b = max(start, lo), min(stop, hi)
            if a < b:
                pieces.append(s.read(a - lo, b - lo))
        if not pieces:
            return np.empty((0,) + self.shape[1:], self.dtype)
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)

    def __reduce__(self) -> tuple[type, tuple[str]]:
        return (type(self), (os.fspath(self.directory),))

    def __repr__(self) -> str:
        return f"<ShardSource {self.directory} {len(self.shards)} shards {self.shape} {self.dtype}>"


class CsvSource:
    """Rows of a numeric .csv file (comma-separated; a non-numeric first line is
    a header), parsed as float64. Reads are fastest in increasing row order."""

    every_rank = False

    def __init__(self, path: PathLike, dtype: Any = np.float64) -> None:
        self.path, self.dtype = Path(path), np.dtype(dtype)
        self._file: IO[str] | None = None
        self._row = 0
        with open(self.path) as f:
            first = f.readline()
            self.header = not _numeric(first)
            rows = 0 if self.header or not first.strip() else 1
            width = len(first.split(",")) if self.header or first.strip() else 0
            for number, line in enumerate(f, start=2):
                if line.strip():
                    rows += 1
                    if line.count(",") + 1 != width:
                        raise SourceError(
                            f"{self.path}: line {number} has {line.count(',') + 1} comma-separated values "
                            f"but line 1 has {width}: every row needs the same number of columns")
        self.shape = (rows, width)

    def _rewind(self) -> IO[str]:
        if self._file is not None:
            self._file.close()
        self._file, self._row = open(self.path), 0
        if self.header:
            self._file.readline()
        return self._file

    def read(self, start: int, stop: int) -> np.ndarray:
        """Return rows start to stop (exclusive)."""
        file = self._rewind() if self._file is None or start < self._row else self._file
        lines = []
        for line in file:
            if not line.strip():
                continue
            if self._row >= start:
                lines.append(line)
            self._row += 1
            if self._row >= stop:
                break
        if not lines:
            return np.empty((0, self.shape[1]), self.dtype)
        try:
            block: np.ndarray = np.loadtxt(lines, delimiter=",", dtype=self.dtype, ndmin=2)
        except ValueError as exc:
            raise SourceError(f"{self.path}: rows {start} to {stop}: {exc}") from None
        if block.shape[1] != self.shape[1]:
            raise SourceError(f"{self.path}: rows {start} to {stop} have {block.shape[1]} columns, "
                              f"expected {self.shape[1]}")
        return block

    def __repr__(self) -> str:
        return f"<CsvSource {self.path} {self.shape}>"


def _numeric(line: str) -> bool:
    try:
        [float(v) for v in line.split(",")]
    except ValueError:
        return False
    return True


class SyntheticTable:
    """A table of normal values, each column with its own offset and scale, made from a seed.

    Rows are generated in fixed blocks of ``BLOCK`` rows, each from its
    own seed, so any range of rows can be generated on its own and reads
    the same values however the table is cut into rounds.
    """

    BLOCK = 65536
    every_rank = True

    def __init__(self, rows: int = 1_000_000, features: int = 16, seed: int = 0) -> None:
        if rows < 0 or features < 1:
            raise SourceError(f"a synthetic table needs rows >= 0 and features >= 1, got {rows} and {features}")
        self.rows, self.features, self.seed = int(rows), int(features), int(seed)
        self.shape, self.dtype = (self.rows, self.features), np.dtype(np.float32)
        rng = np.random.default_rng([self.seed, 0])
        self.loc = rng.uniform(-5.0, 5.0, self.features).astype(np.float32)
        self.scale = rng.uniform(0.5, 3.0, self.features).astype(np.float32)
        self._cached: tuple[int | None, np.ndarray | None] = (None, None)

    def _generate(self, k: int, out: np.ndarray) -> np.ndarray:
        """Fill out with block k's rows (generated in place: no temporaries)."""
        np.random.default_rng([self.seed, 1, k]).standard_normal(out.shape, dtype=np.float32, out=out)
        out *= self.scale  # the same values as z * scale + loc
        out += self.loc
        return out

    def _block(self, k: int) -> np.ndarray:
        kept, block = self._cached
        if kept != k or block is None:
            n = min(self.BLOCK, self.rows - k * self.BLOCK)
            self._cached = (None, None)  # the old block's memory goes before the new one's comes
            block = self._generate(k, np.empty((n, self.features), np.float32))
            self._cached = (k, block)
        return block

    def read(self, start: int, stop: int) -> np.ndarray:
        """Return rows start to stop (exclusive).

        Whole blocks are generated straight into the result; a block cut
        by start or stop is kept, for the next read that starts in it.
        """
        stop = min(stop, self.rows)
        out = np.empty((max(stop - start, 0), self.features), self.dtype)
        for k in range(start // self.BLOCK, (stop - 1) // self.BLOCK + 1 if stop > start else 0):
            lo, hi = k * self.BLOCK, min((k + 1) * self.BLOCK, self.rows)
            a, b = max(start, lo), min(stop, hi)
            if (a, b) == (lo, hi):
                self._generate(k, out[a - start : b - start])
            else:
                out[a - start : b - start] = self._block(k)[a - lo : b - lo]
        return out

    def __reduce__(self) -> tuple[type, tuple[int, int, int]]:
        return (type(self), (self.rows, self.features, self.seed))

    def fingerprint(self) -> str:
        """The table's identity: its size and seed (its rows follow from them)."""
        return f"synthetic {self.rows}x{self.features} seed {self.seed}"

    def __repr__(self) -> str:
        return f"<SyntheticTable {self.rows} x {self.features}, seed {self.seed}>"


#: Rows fingerprint reads, evenly spaced from the first to the last.
SAMPLES = 17


def fingerprint(source: Any) -> str:
    """Return a hex digest of source's shape, dtype and SAMPLES rows spread over it.

    Cheap (a few rows read), and enough to tell another input, or the
    same file changed in most ways, from the one a journal was made from.
    A source with a ``fingerprint()`` method of its own (a synthetic
    table: its size and seed) gives that instead.
    """
    own = getattr(source, "fingerprint", None)
    if callable(own):
        return str(own())
    rows = int(source.shape[0])
    crc = zlib.crc32(repr((tuple(int(n) for n in source.shape), str(np.dtype(source.dtype)))).encode())
    if callable(getattr(source, "identity", None)):  # a format's own metadata (dataset path, chunking, ...)
        crc = zlib.crc32(str(source.identity()).encode(), crc)
    picks = sorted({rows - 1 if k == SAMPLES - 1 else k * rows // SAMPLES for k in range(SAMPLES)}) if rows else []
    for i in picks:
        crc = zlib.crc32(np.ascontiguousarray(source.read(i, i + 1)).tobytes(), crc)
    return f"{crc:08x}"


def open_source(spec: Any, columns: Optional[Sequence[str]] = None, dataset: Optional[str] = None) -> Any:
    """Return a source for spec: an array, a path or a source.

    Paths: .npy, .csv, a directory of .npy shards; with the ``formats``
    extra a .parquet file, a directory or list of them (columns= chooses
    columns), ``file.h5:/dataset`` (or dataset=) and a .zarr store
    (``store.zarr:/array`` in a group).
    """
    if hasattr(spec, "read") and hasattr(spec, "shape") and hasattr(spec, "dtype"):
        return spec
    if isinstance(spec, np.ndarray) or is_tensor(spec):
        return ArraySource(spec)
    from spmd.pipeline.formats import hdf5, names, parquet, zarr_arrays

    if isinstance(spec, (list, tuple)) and spec and all(Path(p).suffix in names.PARQUET for p in spec):
        return parquet.ParquetSource(spec, columns)
    if isinstance(spec, (str, os.PathLike)):
        path = Path(spec)
        if names.split_dataset(spec)[1] is not None or path.suffix in names.HDF5:
            return hdf5.Hdf5Source(spec, dataset)
        if names.is_zarr(spec):
            return zarr_arrays.ZarrSource(spec)
        if path.is_dir():
            if any(p.suffix in names.PARQUET for p in path.rglob("*")):
                return parquet.ParquetSource(path, columns)
            return ShardSource(path)
        if not path.exists():
            raise FileNotFoundError(f"{path}: no such file or directory")
        if path.suffix in names.PARQUET:
            return parquet.ParquetSource(path, columns)
        if path.suffix == ".npy":
            return NpySource(path)
        if path.suffix == ".csv":
            return CsvSource(path)
        raise SourceError(f"{path}: unknown input format; expected .npy, .csv, a directory of .npy shards, "
                          ".parquet (a file or a directory), .h5:/dataset or a .zarr store")
    raise SourceTypeError(
        f"cannot read rows from {type(spec).__name__}; pass an array, a path, or an object "
        "with shape, dtype and read(start, stop)"
    )
