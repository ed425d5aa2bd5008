"""The pipeline on Parquet, Zarr and .npy beside the tools a user would pick instead.

    python -m benchmarks.formats [--rows 1000000] [--repeats 3] [--chunk 131072] [--json FILE]

A 1M x 16 float32 table (the main job's synthetic one) saved as a Parquet
file (row groups of 131,072 rows), a Zarr store (chunks of 65,536 rows) and
a .npy file, mapped by the mlp task into a file of the same format, each
tool launched on its own (:mod:`benchmarks.formats_worker`), interleaved
over repeats: spmd's pipeline on 2 ranks (mpirun), a hand-written mpi4py
loop on 2 ranks (root reads, Scatterv, Gatherv, root writes), Dask with 2
threads, and one process; on Parquet also the loop making spmd's two
choices (columns taken without pandas, float columns without a dictionary).
Then spmd's Parquet read of every row beside pyarrow's ``read_table``.
The report gives medians (seconds, and the CPU seconds of all the tool's
processes and threads) and each target's ratio; every tool's output rows
must have the same checksum, or the run fails.  docs/bench.md.
"""

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from benchmarks import launch_env
from spmd.bench.startup import find_mpirun, launch_record
from spmd.errors import BenchError

__all__ = ["CASES", "prepare", "launch", "measure", "summary", "targets", "report", "main"]

#: (label, implementation, ranks).
CASES = (("spmd pipeline", "spmd", 2), ("mpi4py loop", "mpi4py", 2), ("Dask, 2 threads", "dask", 1),
         ("one process", "serial", 1), ("loop, spmd's choices", "mpi4py-tuned", 2))
FORMATS = ("parquet", "zarr", "npy")
#: The cases run on some formats only: the loop making spmd's two Parquet choices (no pandas, no dictionary for
#: float columns) is the hand-written loop itself on the other formats.
ONLY = {"mpi4py-tuned": ("parquet",)}
#: spmd at most this times Dask's and the hand-written loop's time.
TARGET = 0.8
#: spmd's Parquet read at most this times pyarrow's read_table of the same rows.
READ_TARGET = 1.2


def prepare(folder, rows=1_000_000):
    """Save the table as folder/in.parquet, folder/in.zarr and folder/in.npy; return their paths by format."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zarr

    from spmd.pipeline.sources import SyntheticTable

    table = SyntheticTable(rows, 16, 0).read(0, rows)
    paths = {"parquet": os.path.join(folder, "in.parquet"), "zarr": os.path.join(folder, "in.zarr"),
             "npy": os.path.join(folder, "in.npy")}
    pq.write_table(pa.table({f"x{j}": table[:, j] for j in range(16)}), paths["parquet"], row_group_size=131072)
    zarr.create_array(store=paths["zarr"], shape=table.shape, chunks=(65536, 16), dtype="float32")[:] = table
    np.save(paths["npy"], table)
    return paths


def launch(impl, fmt, src, out, chunk, ranks, timeout=900):
    """Run one launch; return its FORMATS_BENCH record."""
    worker = [sys.executable, "-m", "benchmarks.formats_worker", impl, fmt, src, out, str(chunk)]
    if ranks > 1:
        mpirun = find_mpirun()
        if mpirun is None:
            raise BenchError("the formats benchmark needs mpirun: pip install mpich")
        worker = [mpirun, "-n", str(ranks)] + worker
    env = launch_env({"SPMD_BACKEND": "mpi", "OMP_NUM_THREADS": "1"})
    return launch_record(worker, env, "FORMATS_BENCH", timeout)


def _remove(path):
    if os.path.isdir(path):
        shutil.rmtree(path)
    elif os.path.exists(path):
        os.unlink(path)


def measure(folder, paths, repeats=3, chunk=131072, progress=None):
    """Every case on every format, interleaved (rotated each repeat); return one row per launch."""
    chosen = [(fmt, *case) for fmt in FORMATS for case in CASES if fmt in ONLY.get(case[1], FORMATS)]
    rows = []
    for rep in range(repeats):
        k = rep % len(chosen)
        for fmt, label, impl, ranks in chosen[k:] + chosen[:k]:
            out = os.path.join(folder, f"out-{impl}.{fmt}")
            record = launch(impl, fmt, paths[fmt], out, chunk, ranks)
            _remove(out)
            rows.append({"format": fmt, "case": label, "repeat": rep, **record, "load": os.getloadavg()[0]})
            if progress:
                progress(f"  repeat {rep + 1}/{repeats} {fmt:<8} {label:<16} {record['seconds']:7.3f} s "
                         f"crc {record['crc']} load {rows[-1]['load']:.2f}")
        read = launch("read", "parquet", paths["parquet"], "-", chunk, 1)
        rows.append({"format": "parquet", "case": "read", "repeat": rep, **read})
    return rows


def summary(rows):
    """{(format, case): median seconds}, and the read medians; raise if the tools' outputs differ."""
    out = {}
    for fmt in FORMATS:
        crcs = {r["crc"] for r in rows if r["format"] == fmt and "crc" in r}
        if len(crcs) > 1:
            raise BenchError(f"the tools wrote different rows on {fmt}: checksums {sorted(crcs)}")
        for label, _, _ in CASES:
            got = [r for r in rows if (r["format"], r["case"]) == (fmt, label)]
            if got:
                out[(fmt, label)] = statistics.median(r["seconds"] for r in got)
                if all("cpu" in r for r in got):  # CPU seconds of every process and thread, summed
                    out[(fmt, label, "cpu")] = statistics.median(sum(r["cpu"]) for r in got)
    reads = [r for r in rows if r["case"] == "read"]
    if reads:
        for k in ("spmd", "read_table", "read_table_2d", "spmd_cpu", "read_table_cpu"):
            if all(k in r for r in reads):
                out[("read", k)] = statistics.median(r[k] for r in reads)
    return out


def targets(s):
    """[(target, met, how)]."""
    found = []
    for fmt in FORMATS:
        mine = s.get((fmt, "spmd pipeline"))
        for other in ("Dask, 2 threads", "mpi4py loop"):
            theirs = s.get((fmt, other))
            if mine and theirs:
                found.append((f"{fmt}: spmd at most {TARGET}x {other}", mine / theirs <= TARGET,
                              f"{mine:.3f} s against {theirs:.3f} s: {mine / theirs:.2f}x"))
    if ("read", "spmd") in s:
        ratio = s[("read", "spmd")] / s[("read", "read_table")]
        found.append((f"Parquet read at most {READ_TARGET}x pyarrow's read_table", ratio <= READ_TARGET,
                      f"{s[('read', 'spmd')]:.3f} s against {s[('read', 'read_table')]:.3f} s: {ratio:.2f}x "
                      f"(read_table and its 2-D array: {s[('read', 'read_table_2d')]:.3f} s)" + (
                          f"; CPU {s[('read', 'spmd_cpu')]:.3f} s against {s[('read', 'read_table_cpu')]:.3f} s: "
                          f"{s[('read', 'spmd_cpu')] / s[('read', 'read_table_cpu')]:.2f}x"
                          if ("read", "spmd_cpu") in s else "")))
    return found


def report(doc):
    """The table for people."""
    s = summary(doc["rows"])
    lines = [f"{doc['table_rows']:,} x 16 float32 -> mlp -> 8 columns, chunk {doc['chunk']:,} rows, "
             f"medians of {doc['repeats']} interleaved launches (seconds of work, after start-up)", "",
             f"{'case':<18} " + " ".join(f"{fmt:>9} {'cpu s':>6}" for fmt in FORMATS)]
    for label, _, _ in CASES:
        lines.append(f"{label:<18} " + " ".join(f"{s.get((fmt, label), float('nan')):>9.3f} "
                                                f"{s.get((fmt, label, 'cpu'), float('nan')):>6.3f}" for fmt in FORMATS))
    lines += ["", "targets:"] + [f"  {'met    ' if ok else 'NOT met'}  {t}: {how}" for t, ok, how in targets(s)]
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.formats", description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--chunk", type=int, default=131072)
    p.add_argument("--json", dest="json_path")
    o = p.parse_args(argv)
    progress = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    folder = tempfile.mkdtemp(prefix="spmd-bench-formats-")
    try:
        paths = prepare(folder, o.rows)
        doc = {"schema": "spmd-bench-formats/1", "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
               "table_rows": o.rows, "chunk": o.chunk, "repeats": o.repeats,
               "rows": measure(folder, paths, o.repeats, o.chunk, progress)}
    except (BenchError, subprocess.TimeoutExpired, ImportError) as exc:
        sys.exit(f"python -m benchmarks.formats: {exc}")
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    print(report(doc))
    if o.json_path:
        from spmd.bench.report import write_json

        write_json(o.json_path, doc)


if __name__ == "__main__":
    main()
