"""A slow resumable pipeline, to be killed with SIGKILL halfway and run again (tests/pipeline/test_journal.py).

    python resumable.py OUTPUT ROWS CHUNK [SECONDS_PER_ROUND [INPUT]]

Every rank reads its own rows of a synthetic table, or of INPUT (a
.parquet, .h5:/dataset or .zarr holding that table), counted, doubles
them after a pause, and writes them into OUTPUT with resume=True. Rank 0
prints "RESUMED <rows> ROUNDS <n> PROCESSED <rows> READ <rows>" at the
end, READ being the rows every rank read in this run, added up.
"""

import sys
import time

import numpy as np

from spmd import comm
from spmd.pipeline.grid import ANY_ROW
from spmd.pipeline.run import SyntheticTable, open_source, pipeline
from spmd.pipeline.sources import fingerprint

output, rows, chunk = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
pause = float(sys.argv[4]) if len(sys.argv) > 4 else 0.05
given = sys.argv[5] if len(sys.argv) > 5 else None
read_rows = [0]


class Counted(SyntheticTable):
    """A synthetic table that counts the rows this rank reads."""

    def read(self, start, stop):
        read_rows[0] += stop - start
        return super().read(start, stop)


def double_slowly(block):
    time.sleep(pause)
    return block * np.float32(2)


class CountedFile:
    """A file's source that counts the rows this rank reads (opened again on every rank from its path)."""

    every_rank = True

    def __init__(self, path):
        self.path, self.inner = path, open_source(path)
        self.shape, self.dtype = self.inner.shape, self.inner.dtype
        self.columns = getattr(self.inner, "columns", None)  # a Parquet input's names, kept by the output

    def read(self, start, stop):
        read_rows[0] += stop - start
        return self.inner.read(start, stop)

    def identity(self):
        return self.inner.identity()

    def grid(self):  # the file's chunk edges, as the file itself gives them (a Zarr output keeps them)
        own = getattr(self.inner, "grid", None)
        return own() if callable(own) else ANY_ROW

    def fingerprint(self):  # the journal's, read from the file itself: not counted
        return fingerprint(self.inner)

    def __repr__(self):  # the journal records it: the same in every run
        return f"<counted {self.inner!r}>"

    def __reduce__(self):
        return (CountedFile, (self.path,))


source = None
if comm.rank == 0:
    source = CountedFile(given) if given else Counted(rows, 4, seed=7)
result = pipeline(double_slowly, source, output=output, chunk_rows=chunk, resume=True, task="double slowly")
total_read = sum(comm.all_gather_object(read_rows[0]))
if comm.rank == 0:
    print(result.summary(), flush=True)
    print(f"RESUMED {result.resumed_rows} ROUNDS {result.resumed_rounds} PROCESSED {result.rows_processed} "
          f"READ {total_read} MODE {result.read_mode}/{result.write_mode}", flush=True)
