"""Parquet (pyarrow): a file, a directory or a list of files read as one table of numeric columns.

:class:`ParquetSource` reads only the row groups a rank's rows lie in,
and only the columns chosen; every rank opens the files itself (their
footers tell each rank where its rows are).  The columns become one
2-D array of numpy's common type of theirs: a table of float32 columns
stays float32, int64 beside float32 becomes float64 (said in
:attr:`ParquetSource.notes`).  A column that is not numeric, or holds
nulls, is refused with its name.  The output: :mod:`.parquet_output`.
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import numpy as np

from spmd.errors import SourceError
from spmd.pipeline.formats.extra import need
from spmd.pipeline.formats.names import PARQUET as SUFFIXES
from spmd.pipeline.grid import Grid

__all__ = ["ParquetSource", "parquet_paths", "column_into", "SUFFIXES"]



def _natural(name: str) -> list[Union[int, str]]:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def parquet_paths(spec: Any) -> list[Path]:
    """The files of a Parquet dataset: one file, a list of files, or a directory's (recursively, natural order)."""
    if isinstance(spec, (list, tuple)):
        paths = [Path(p) for p in spec]
    elif Path(spec).is_dir():
        root = Path(spec)
        paths = sorted((p for p in root.rglob("*") if p.suffix in SUFFIXES and p.is_file()),
                       key=lambda p: _natural(os.fspath(p.relative_to(root))))
        if not paths:
            raise SourceError(f"{root}: no .parquet files in this directory")
    else:
        paths = [Path(spec)]
    for p in paths:
        if not p.is_file():
            raise SourceError(f"{p}: no such Parquet file")
    if not paths:
        raise SourceError("an empty list of Parquet files: name at least one")
    return paths


def column_into(out: np.ndarray, column: Any) -> None:
    """Copy a numeric Arrow column without nulls into out (its rows), from the chunks' value buffers.

    Not pyarrow's ``to_numpy``: its first call in a process imports pandas
    (0.25 s here), which a pipeline never needs.
    """
    at = 0
    for chunk in column.chunks:
        n = len(chunk)
        data = chunk.buffers()[1]
        if chunk.type.bit_width == 1:  # boolean: one bit a value, least significant first
            bits = np.unpackbits(np.frombuffer(data, np.uint8), bitorder="little")
            out[at : at + n] = bits[chunk.offset : chunk.offset + n]
        else:
            dtype = np.dtype(chunk.type.to_pandas_dtype())
            out[at : at + n] = np.frombuffer(data, dtype, count=n, offset=chunk.offset * dtype.itemsize)
        at += n


def _numeric(pa: Any, t: Any) -> bool:
    return bool(pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t))


class ParquetSource:
    """Rows of a Parquet dataset: the chosen numeric columns (all by default) as one 2-D array.

    spec: a file, a directory (every .parquet file under it, in natural
    order) or a list of files; every file must have the same columns of
    the same types.  columns: the names to read, in this order.
    """

    every_rank = True

    def __init__(self, spec: Any, columns: Optional[Sequence[str]] = None) -> None:
        pa = need("pyarrow", "reading Parquet")
        pq = need("pyarrow.parquet", "reading Parquet")
        self.spec = [os.fspath(p) for p in spec] if isinstance(spec, (list, tuple)) else os.fspath(spec)
        self.paths = parquet_paths(spec)
        self.files = []
        for p in self.paths:
            try:
                self.files.append(pq.ParquetFile(p, memory_map=True))
            except Exception as exc:
                raise SourceError(f"{p}: not a readable Parquet file ({type(exc).__name__}: {exc}); was it "
                                  "copied completely?") from None
        schema = self.files[0].schema_arrow
        for p, f in zip(self.paths[1:], self.files[1:]):
            if not f.schema_arrow.equals(schema):
                mine = {n: str(t) for n, t in zip(f.schema_arrow.names, f.schema_arrow.types)}
                first = {n: str(t) for n, t in zip(schema.names, schema.types)}
                differ = sorted(set(mine.items()) ^ set(first.items()))
                raise SourceError(f"{p} and {self.paths[0]} have different schemas (they differ in "
                                  f"{', '.join(sorted({n for n, _ in differ}))}: {p.name} has "
                                  f"{_fields(mine, differ)}, {self.paths[0].name} has {_fields(first, differ)}); "
                                  "every file of a dataset must have the same columns and types")
        names = list(schema.names)
        self.columns = list(columns) if columns else names
        missing = [c for c in self.columns if c not in names]
        if missing:
            raise SourceError(f"{self.paths[0]}: no column {', '.join(map(repr, missing))}; its columns are "
                              f"{', '.join(names)}")
        types = {c: schema.field(c).type for c in self.columns}
        bad = [f"{c} ({t})" for c, t in types.items() if not _numeric(pa, t)]
        if bad:
            good = [c for c, t in types.items() if _numeric(pa, t)]
            raise SourceError(f"{self.paths[0]}: column{'s' * (len(bad) > 1)} {', '.join(bad)} "
                              f"{'are' if len(bad) > 1 else 'is'} not numeric; choose numeric columns with "
                              f"columns= (--columns {','.join(good) or 'NAME,...'})")
        dtypes = {c: np.dtype(t.to_pandas_dtype()) for c, t in types.items()}
        self.dtype = np.result_type(*dtypes.values())
        self.notes: list[str] = []
        if len(set(dtypes.values())) > 1:
            self.notes.append("the columns' types differ (" + ", ".join(f"{c} {d}" for c, d in dtypes.items())
                              + f"): read as {self.dtype}, numpy's common type, which holds every one")
        self.groups = [(i, g, f.metadata.row_group(g).num_rows)
                       for i, f in enumerate(self.files) for g in range(f.metadata.num_row_groups)]
        self.starts = np.cumsum([0] + [n for _, _, n in self.groups])
        self.shape = (int(self.starts[-1]), len(self.columns))
        self._cached: tuple[Optional[int], Optional[np.ndarray]] = (None, None)

    def _read_group(self, k: int, out: Optional[np.ndarray] = None) -> np.ndarray:
        i, g, n = self.groups[k]
        try:
            table = self.files[i].read_row_group(g, columns=self.columns, use_threads=False)
        except Exception as exc:
            raise SourceError(f"{self.paths[i]}: row group {g} cannot be read ({type(exc).__name__}: {exc}); "
                              "is the file damaged or truncated?") from None
        if out is None:
            out = np.empty((n, len(self.columns)), self.dtype)
        for j, c in enumerate(self.columns):
            col = table.column(c)
            if col.null_count:
                raise SourceError(f"{self.paths[i]}: column {c!r} holds {col.null_count} nulls in row group {g}; "
                                  "fill or drop them before the pipeline reads it (its rows become one array)")
            column_into(out[:, j], col)
        return out

    def read(self, start: int, stop: int) -> np.ndarray:
        """Return rows start to stop (exclusive): whole row groups straight into the result, a cut one kept."""
        stop = min(stop, self.shape[0])
        out = np.empty((max(stop - start, 0), self.shape[1]), self.dtype)
        if stop <= start:
            return out
        first = int(np.searchsorted(self.starts, start, side="right")) - 1
        k = first
        while k < len(self.groups) and self.starts[k] < stop:
            lo, hi = int(self.starts[k]), int(self.starts[k + 1])
            a, b = max(start, lo), min(stop, hi)
            if (a, b) == (lo, hi):
                self._read_group(k, out[a - start : b - start])
            elif b > a:
                kept, block = self._cached
                if kept != k or block is None:
                    self._cached = (None, None)
                    block = self._read_group(k)
                    self._cached = (k, block)
                out[a - start : b - start] = block[a - lo : b - lo]
            k += 1
        return out

    def grid(self) -> Grid:
        """Row group starts: a share edge there decodes no group twice (every k rows where the groups are
        all k rows but the last)."""
        sizes = [n for _, _, n in self.groups]
        if len(sizes) > 1 and len(set(sizes[:-1])) == 1 and sizes[-1] <= sizes[0]:
            return Grid.of(sizes[0], why=f"the input's Parquet row groups of {sizes[0]} rows")
        return Grid.of(edges=[int(x) for x in self.starts], why="the input's Parquet row groups")

    def identity(self) -> str:
        """The dataset's identity from its footers: schema, row groups and their statistics (no rows read)."""
        h = hashlib.sha256()
        for p, f in zip(self.paths, self.files):
            meta = f.metadata
            h.update(f"{p.name} {meta.num_rows} {meta.num_row_groups}".encode())
            for g in range(meta.num_row_groups):
                rg = meta.row_group(g)
                for j in range(rg.num_columns):
                    col = rg.column(j)
                    st = col.statistics
                    stats = (st.min, st.max, st.null_count) if st is not None and st.has_min_max else None
                    h.update(f"{col.path_in_schema} {col.total_compressed_size} {stats}".encode())
        types = ", ".join(f"{c}: {self.files[0].schema_arrow.field(c).type}" for c in self.columns)
        return (f"parquet {len(self.paths)} file(s), {self.shape[0]} rows, {len(self.groups)} row groups, "
                f"columns {types}; footers {h.hexdigest()[:16]}")

    fingerprint = identity

    def __reduce__(self) -> tuple[type, tuple[Any, Optional[list[str]]]]:
        return (type(self), (self.spec, self.columns))

    def __repr__(self) -> str:
        where = self.spec if isinstance(self.spec, str) else f"{len(self.paths)} files"
        return f"<ParquetSource {where} {self.shape} {self.dtype}>"


def _fields(fields: dict[str, str], differ: list[tuple[str, str]]) -> str:
    names = sorted({n for n, _ in differ})
    return ", ".join(f"{n}: {fields[n]}" if n in fields else f"no {n}" for n in names)
