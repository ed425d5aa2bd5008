"""Where a pipeline's root puts the results: an array in memory, a .npy file written as it goes, or a callable."""

import os
from pathlib import Path

import numpy as np

from .atomic import AtomicFile
from .errors import PipelineTypeError

__all__ = ["open_sink", "Collect", "NpyWriter", "Call"]


class Collect:
    """Keep the blocks in memory; close returns them as one array."""

    def __init__(self):
        self.parts = []

    def __call__(self, start, block):
        self.parts.append(block)

    def close(self, ok, empty):
        if not ok:
            return None
        return np.concatenate(self.parts) if self.parts else empty


class NpyWriter:
    """Write a .npy file block by block; it appears under its name only when complete (spmd.atomic)."""

    def __init__(self, path, rows):
        self.path, self.rows = Path(path), rows
        self.out = None

    def __call__(self, start, block):
        if self.out is None:
            self.out = AtomicFile(self.path)
            header = {
                "descr": np.lib.format.dtype_to_descr(block.dtype),
                "fortran_order": False,
                "shape": (self.rows,) + block.shape[1:],
            }
            np.lib.format.write_array_header_2_0(self.out.file, header)
        self.out.file.write(np.ascontiguousarray(block).data)

    def close(self, ok, empty):
        if ok and self.out is None:
            self(0, empty)
        if self.out is None:
            return None
        if ok:
            self.out.commit()
            return self.path
        self.out.discard()
        return None


class Call:
    """Hand every block to fn(start_row, block); close returns None."""

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, start, block):
        self.fn(start, block)

    def close(self, ok, empty):
        return None


def open_sink(output, rows):
    """Return the sink for output: None (collect), a .npy path of rows rows, or a callable(start, block).

    A sink is called with (start_row, block) for every round, in row
    order, and then close(ok, empty) once: it returns what the Result
    shows as output, and with ok False leaves nothing half written.
    """
    if output is None:
        return Collect()
    if isinstance(output, (str, os.PathLike)):
        return NpyWriter(output, rows)
    if callable(output):
        return Call(output)
    raise PipelineTypeError(f"output must be None, a .npy path or a callable(start, block), "
                            f"got {type(output).__name__}")
