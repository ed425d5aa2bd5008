"""A .parquet output (pyarrow): root writes row groups of a fixed size, in row order.

The row groups' size is set by the row's size alone, so the same rows
give the same file at every world size, chunk_rows and balance.  A
resumable run keeps each round as a file of ``<out>.partial/`` and
joins them into the output at the end.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import numpy as np

from spmd.errors import PipelineError, PipelineValueError
from spmd.pipeline.formats.extra import need
from spmd.pipeline.formats.parquet import column_into
from spmd.pipeline.sinks import check_output, partial_path
from spmd.util.atomic import AtomicFile

__all__ = ["ParquetOutput", "ROW_GROUP_BYTES", "arrow_column"]


#: An output's row group holds about this many bytes (set by the row's size alone, so the file's bytes are
#: the same at every world size, chunk_rows and balance).  8 MiB: a pipeline reading the output back shares it
#: over its ranks by row groups, and root encodes each group beside the next rounds' compute (with 64 MiB, an
#: output under 64 MiB was one row group, encoded after the last round and read back by one rank).
ROW_GROUP_BYTES = 8 << 20


class _Regroup:
    """Write tables to a ParquetWriter in row groups of exactly group_rows rows (the last one shorter), or
    each table as one row group (group_rows None)."""

    def __init__(self, writer: Any, group_rows: Optional[int]) -> None:
        self.writer, self.group_rows = writer, group_rows
        self.pending: list[Any] = []
        self.count = 0

    def add(self, table: Any) -> None:
        if self.group_rows is None:
            if table.num_rows:
                self.writer.write_table(table, row_group_size=table.num_rows)
            return
        self.pending.append(table)
        self.count += table.num_rows
        if self.count >= self.group_rows:
            pa = need("pyarrow", "writing Parquet")
            whole = pa.concat_tables(self.pending)
            cut = self.count - self.count % self.group_rows
            self.writer.write_table(whole.slice(0, cut), row_group_size=self.group_rows)
            rest = whole.slice(cut)
            self.pending, self.count = ([rest] if rest.num_rows else []), rest.num_rows

    def close(self) -> None:
        if self.count:
            pa = need("pyarrow", "writing Parquet")
            self.writer.write_table(pa.concat_tables(self.pending), row_group_size=self.group_rows)
        self.pending, self.count = [], 0
        self.writer.close()


class ParquetOutput:
    """A .parquet output: one file, row groups in row order, columns c0, c1, ... (or the input's names).

    Root writes it.  Rows of one dimension make one column c0; rows of
    k values, k columns.  Row groups hold ``row_group_rows`` rows (default
    about :data:`ROW_GROUP_BYTES`), whatever the rounds: the same rows give
    the same file; ``row_group_rows="round"`` makes each round a row group
    (then the file follows chunk_rows and the balance's round ends).  A resumable run keeps each round as a file of
    ``<out>.partial/`` (synced before the journal records it) and joins
    them into the output at the end.
    """

    positional = True
    parallel = False
    why_root = "Parquet outputs are written by root (row groups in row order; the encoding takes one writer)"
    threaded = True

    def __init__(self, path: Any, rows: int, resume: bool = False, names: Optional[Sequence[str]] = None,
                 row_group_rows: Union[int, str, None] = None) -> None:
        check_output(path)
        if row_group_rows is not None and row_group_rows != "round" and (
                isinstance(row_group_rows, bool) or not isinstance(row_group_rows, int) or row_group_rows < 1):
            raise PipelineValueError(f"output {path}: row_group_rows={row_group_rows!r}; give the rows of a row "
                                     "group (a whole number of at least 1) or 'round' (one row group per round)")
        self.path, self.rows, self.resume = Path(path), int(rows), resume
        self.partial = partial_path(self.path) if resume else None
        self.input_names = list(names) if names else None
        self.row_group_rows = row_group_rows
        self.writer: Any = None
        self.where: Optional[str] = None
        self.atomic: Any = None
        self.last: Optional[Path] = None
        self.dtype: Any = None
        self.row_shape: tuple = ()
        self.row_bytes = 0

    def _layout(self, dtype: Any, row_shape: tuple) -> None:
        self.dtype, self.row_shape = np.dtype(dtype), tuple(int(n) for n in row_shape)
        if len(self.row_shape) > 1:
            raise PipelineValueError(f"output {self.path}: a Parquet file holds columns, so fn must return rows "
                                     f"of one value or one dimension; it returned rows of shape {self.row_shape}"
                                     " (reshape them, or write .npy, .h5 or .zarr)")
        width = self.row_shape[0] if self.row_shape else 1
        self.names = (self.input_names if self.input_names and len(self.input_names) == width
                      else [f"c{j}" for j in range(width)])
        self.row_bytes = self.dtype.itemsize * width
        self.group_rows: Optional[int] = (None if self.row_group_rows == "round" else
                                          self.row_group_rows or max(1, ROW_GROUP_BYTES // max(self.row_bytes, 1)))

    def _table(self, block: np.ndarray) -> Any:
        pa = need("pyarrow", "writing Parquet")
        cols = [block] if block.ndim == 1 else [block[:, j] for j in range(block.shape[1])]
        return pa.Table.from_arrays([arrow_column(pa, c) for c in cols], names=self.names)

    def _encoding(self) -> dict:
        """pyarrow's writer options: no dictionary for floating-point columns.

        A map's float output is nearly all distinct values, where pyarrow's
        default dictionary encoding is pure cost: for the benchmark's
        1M x 8 float32 output it took 0.66 s and 49 MB against 0.05 s and
        32 MB plain.  Integer and boolean columns (labels, counts) keep it.
        """
        return {"use_dictionary": self.dtype.kind != "f"}

    def _writer(self, where: str) -> _Regroup:
        pq = need("pyarrow.parquet", "writing Parquet")
        schema = self._table(np.empty((0,) + self.row_shape, self.dtype)).schema
        return _Regroup(pq.ParquetWriter(where, schema, **self._encoding()), self.group_rows)

    def create(self, dtype: Any, row_shape: tuple) -> str:
        """Start the output: its temporary file, or a resumable run's folder of rounds."""
        self._layout(dtype, row_shape)
        if self.resume:
            assert self.partial is not None
            shutil.rmtree(self.partial, ignore_errors=True)
            self.partial.mkdir()
            self.where = self.writer = os.fspath(self.partial)
        else:
            self.atomic = AtomicFile(self.path)
            self.where = self.atomic.tmp
            self.writer = self._writer(self.where)
        return self.where

    def reopen(self, dtype: Any, row_shape: tuple) -> str:
        """Take up a resumed run's folder of rounds."""
        self._layout(dtype, row_shape)
        assert self.partial is not None
        if not self.partial.is_dir():
            raise PipelineError(f"{self.partial} is missing: the journal {self.path}.journal belongs to it; "
                                "delete the journal to start over")
        self.where = self.writer = os.fspath(self.partial)
        return self.where

    def _parts(self) -> list[tuple[int, int, Path]]:
        assert self.partial is not None
        found = []
        for p in self.partial.glob("rows-*.parquet"):
            a, b = (int(n) for n in p.stem.split("-")[1:3])
            found.append((a, b, p))
        return sorted(found)

    def read_rows(self, start: int, stop: int) -> np.ndarray:
        """The rows of the round start to stop, as a resumable run kept them."""
        pq = need("pyarrow.parquet", "reading Parquet")
        path = Path(self.where or "") / f"rows-{start:012d}-{stop:012d}.parquet"
        table = pq.read_table(path, use_threads=False)
        return _rows(table, self.names, self.dtype, self.row_shape)

    def __call__(self, start: int, block: np.ndarray) -> None:
        if self.writer is None:
            self.create(block.dtype, block.shape[1:])
        if not self.resume:
            self.writer.add(self._table(block))
            return
        pq = need("pyarrow.parquet", "writing Parquet")
        for a, _, p in self._parts():  # rounds written in order: any part from here on is a killed run's
            if a >= start:
                p.unlink()
        stop = start + block.shape[0]
        self.last = Path(self.where or "") / f"rows-{start:012d}-{stop:012d}.parquet"
        pq.write_table(self._table(block), self.last, **self._encoding())

    def sync(self) -> None:
        """Make the last round's file durable (a resumable run, before the journal records it)."""
        if self.last is not None:
            fd = os.open(self.last, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def close(self, ok: bool, empty: Any) -> Optional[Path]:
        """Finish the file and put it in place (ok), or remove it (plain) / keep the rounds (resumable)."""
        if ok and self.writer is None:
            self.create(empty.dtype, empty.shape[1:])
        if self.writer is None:
            return None
        if not ok:
            if self.atomic is not None:
                with contextlib.suppress(Exception):
                    self.writer.writer.close()
                self.atomic.discard()
            self.writer = None
            return None
        if self.resume:
            self._join()
        else:
            self.writer.close()
            self.atomic.commit()
        self.writer = None
        return self.path

    def _join(self) -> None:
        """Join a resumable run's rounds into the output, regrouped as a plain run writes them."""
        pq = need("pyarrow.parquet", "reading Parquet")
        self.atomic = AtomicFile(self.path)
        out = self._writer(self.atomic.tmp)
        at = 0
        for a, b, p in self._parts():
            if a != at:
                raise OSError(f"{self.partial}: the rounds do not join (rows {at} to {a} missing)")
            out.add(pq.read_table(p, use_threads=False))
            at = b
        if at != self.rows:
            raise OSError(f"{self.partial}: rows {at} to {self.rows} are missing")
        out.close()
        self.atomic.commit()
        assert self.partial is not None
        shutil.rmtree(self.partial, ignore_errors=True)


def arrow_column(pa: Any, values: np.ndarray) -> Any:
    """An Arrow array of a 1-D numpy array's values, built on its buffer (not ``pa.array``: its first call in
    a process imports pandas, 0.25 s here)."""
    values = np.ascontiguousarray(values)
    data = np.packbits(values, bitorder="little") if values.dtype == np.bool_ else values
    return pa.Array.from_buffers(pa.from_numpy_dtype(values.dtype), len(values), [None, pa.py_buffer(data)])


def _rows(table: Any, names: list[str], dtype: Any, row_shape: tuple) -> np.ndarray:
    out = np.empty((table.num_rows,) + row_shape, dtype)
    if not row_shape:
        column_into(out, table.column(names[0]))
        return out
    for j, c in enumerate(names):
        column_into(out[:, j], table.column(c))
    return out
