"""Which sink takes a pipeline's output: by its type and, for a path, by its ending.

:func:`open_sink` chooses among :mod:`spmd.pipeline.sinks` (memory, .npy,
a callable) and the formats of :mod:`spmd.pipeline.formats` (.parquet,
.h5, .zarr); an ending the pipeline reads but does not write is refused.
:class:`Output` is a path with its format's options:
``Output("out.parquet", row_group_rows=100_000)``.
"""

import os
from pathlib import Path
from typing import Any, Union

from spmd.errors import PipelineTypeError, PipelineValueError
from spmd.pipeline.formats import hdf5, names, zarr_arrays
from spmd.pipeline.formats.parquet_output import ParquetOutput
from spmd.pipeline.sinks import Call, Collect, NpyFile

__all__ = ["open_sink", "Output", "OPTIONS"]

#: The options each output format takes in :class:`Output`.
OPTIONS = {
    "Parquet": ("row_group_rows",),  # rows per row group, or "round": one per round
    "Zarr": ("chunk_rows",),  # rows per chunk (each written whole by one rank)
    "HDF5": (),
    ".npy": (),
}


class Output:
    """An output path and its format's options (see OPTIONS): Output("out.zarr", chunk_rows=65536)."""

    def __init__(self, path: Union[str, "os.PathLike[str]"], **options: Any) -> None:
        self.path, self.options = os.fspath(path), dict(options)

    def __fspath__(self) -> str:
        return self.path

    def __str__(self) -> str:
        return self.path

    def __repr__(self) -> str:
        given = "".join(f", {k}={v!r}" for k, v in self.options.items())
        return f"Output({self.path!r}{given})"


def _options(path, kind, options):
    """The options kind takes, from options; refuse any other."""
    unknown = sorted(set(options) - set(OPTIONS[kind]))
    if unknown:
        takes = ", ".join(OPTIONS[kind]) or "none"
        raise PipelineValueError(f"output {path}: the {kind} output takes no option {', '.join(unknown)} "
                                 f"(it takes: {takes})")
    return options

#: Endings of formats the pipeline reads but does not write (an output named so is refused, not written as .npy).
_NOT_WRITTEN = (".csv", ".tsv", ".txt", ".json", ".npz", ".pt", ".pkl")


def open_sink(output, rows, resume=False, columns=None):
    """Return the sink for output: None (collect), a path of rows rows, or a callable(start, block).

    Paths: .npy; with the ``formats`` extra .parquet (columns: the input's
    column names, kept when the widths agree), ``.h5:/dataset`` and .zarr.
    A sink is called with (start_row, block) for every round, in row
    order, and then close(ok, empty) once: it returns what the Result
    shows as output, and with ok False leaves nothing half written
    (a resumable one keeps its ``.partial``).
    """
    if output is None:
        return Collect()
    options = {}
    if isinstance(output, Output):
        output, options = output.path, output.options
    if isinstance(output, (str, os.PathLike)):
        path = Path(output)
        if path.suffix in names.PARQUET:
            return ParquetOutput(output, rows, resume=resume, names=columns, **_options(path, "Parquet", options))
        if names.split_dataset(output)[1] is not None or path.suffix in names.HDF5:
            return hdf5.Hdf5File(output, rows, resume=resume, **_options(path, "HDF5", options))
        if path.suffix == ".zarr":
            return zarr_arrays.ZarrStore(output, rows, resume=resume, **_options(path, "Zarr", options))
        if path.suffix in _NOT_WRITTEN:
            raise PipelineValueError(f"output {path}: spmd does not write {path.suffix} files; name a .npy, "
                                     ".parquet, .h5 (file.h5:/dataset) or .zarr output")
        return NpyFile(output, rows, resume=resume, **_options(path, ".npy", options))
    if callable(output):
        return Call(output)
    raise PipelineTypeError(f"output must be None, a .npy path or a callable(start, block), "
                            f"got {type(output).__name__}")
