"""What a path names, by its form alone: an HDF5 file and dataset, a Zarr store; no format library imported.

Shared by the sources, the outputs and the output check of
:mod:`spmd.pipeline.sinks`, so that each finds a format the same way.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional

from spmd.errors import SourceError

__all__ = ["PARQUET", "HDF5", "split_dataset", "split_array", "has_metadata", "is_zarr", "libraries"]

#: The endings of Parquet files.
PARQUET = (".parquet", ".pq")
#: The endings of HDF5 files.
HDF5 = (".h5", ".hdf5", ".hdf", ".he5")


def split_dataset(spec: Any, dataset: Optional[str] = None) -> tuple[Path, Optional[str]]:
    """(file, dataset) from ``file.h5:/group/name`` or a file and a separate dataset name."""
    text = os.fspath(spec)
    for suffix in HDF5:
        mark = text.find(suffix + ":")
        if mark >= 0:
            path, inside = text[: mark + len(suffix)], text[mark + len(suffix) + 1 :]
            if dataset is not None and dataset.strip("/") != inside.strip("/"):
                raise SourceError(f"{text}: names dataset {inside!r} but the dataset given is {dataset!r}; "
                                  "name it once")
            return Path(path), "/" + inside.strip("/")
    return Path(text), None if dataset is None else "/" + dataset.strip("/")


def split_array(spec: Any, name: Optional[str] = None) -> tuple[str, Optional[str]]:
    """(store, array path inside it or None) from ``store.zarr:/group/name``."""
    text = os.fspath(spec)
    mark = text.find(".zarr:")
    if mark >= 0:
        return text[: mark + 5], text[mark + 6 :].strip("/") or None
    return text, None if name is None else name.strip("/") or None


def has_metadata(where: Path) -> bool:
    """Whether the directory where holds a Zarr store's metadata (format 3 or 2)."""
    return any((where / m).is_file() for m in ("zarr.json", ".zarray", ".zgroup"))


def is_zarr(path: Any) -> bool:
    """Whether path (its part before ``:/``) names a Zarr store: a .zarr name, or a directory with its metadata."""
    where = Path(split_array(path)[0])
    return where.suffix == ".zarr" or has_metadata(where)


def libraries(*specs: Any) -> list[str]:
    """The format libraries the paths among specs will import (by their names; a directory by its
    metadata or its first entries), for ranks to import them early; anything else names none."""
    found: list[str] = []
    for spec in specs:
        spec = getattr(spec, "path", spec)  # spmd.pipeline.outputs.Output
        items = spec if isinstance(spec, (list, tuple)) and all(isinstance(p, (str, os.PathLike)) for p in spec) \
            else [spec]
        for item in items:
            if isinstance(item, (str, os.PathLike)):
                try:
                    found += _library(item)
                except (OSError, ValueError, SourceError):  # a guess only: the source's open says what is wrong
                    pass
    return sorted(set(found))


def _library(item: Any) -> list[str]:
    path = Path(split_array(split_dataset(item)[0])[0])
    if split_dataset(item)[1] is not None or path.suffix in HDF5:
        return ["h5py"]
    if is_zarr(item):
        return ["zarr"]
    first = [p for _, p in zip(range(64), path.iterdir())] if path.is_dir() else []
    if path.suffix in PARQUET or any(p.suffix in PARQUET for p in first):
        return ["pyarrow.parquet"]
    return []
