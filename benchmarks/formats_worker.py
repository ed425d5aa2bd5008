"""One launch of the formats benchmark: one tool's read-map-write of a Parquet file, Zarr store or .npy file.

    mpirun -n 2 python -m benchmarks.formats_worker spmd|mpi4py|mpi4py-tuned FORMAT INPUT OUTPUT CHUNK
    python -m benchmarks.formats_worker serial|dask|read FORMAT INPUT OUTPUT CHUNK

FORMAT is parquet, zarr or npy.  The map is the main job's mlp task (16 float32
columns in, 8 out), the same function for every tool; each process uses
one torch thread.  Root prints one line, ``FORMATS_BENCH {json}``: the
seconds from the start of the work (after imports and a warm-up call,
ranks past a barrier) until the output is complete, each process's CPU
seconds over that time (every thread's: ``time.process_time``), and a
checksum of the output's rows.  ``read`` times spmd's Parquet source against
pyarrow's ``read_table`` of the same rows, alternately.  docs/bench.md.
"""

import json
import sys
import threading
import time
import zlib

import numpy as np

FEATURES, SEED, OUT_WIDTH = 16, 0, 8
NAMES = [f"c{j}" for j in range(OUT_WIDTH)]

_local = threading.local()


def compute(block):
    """The mlp task's fn (weights from the seed alone), one per thread: the task keeps a padded buffer
    between calls, so two of Dask's threads must not share one.  Module-level: a process pool pickles it."""
    fn = getattr(_local, "fn", None)
    if fn is None:
        import torch

        from spmd.pipeline import tasks

        torch.set_num_threads(1)
        fn = _local.fn = tasks.get("mlp").make(FEATURES, SEED, None)
    return np.asarray(fn(np.ascontiguousarray(block, dtype=np.float32)))


def frame_part(df):
    """Dask's map over one partition of the Parquet file (module-level: Dask names tasks by it)."""
    import pandas as pd

    return pd.DataFrame(compute(df.to_numpy(np.float32)), columns=NAMES, index=df.index)


def _report(fmt, seconds, out, cpu, **extra):
    """Print the launch's line: seconds and cpu as timed by the caller (gathering them and reading the output
    back are not)."""
    rows = _read_all(fmt, out)
    line = {"seconds": seconds, "cpu": cpu, "rows": int(rows.shape[0]),
            "crc": f"{zlib.crc32(np.ascontiguousarray(rows, np.float32).tobytes()):08x}", **extra}
    print("FORMATS_BENCH " + json.dumps(line), flush=True)


def _read_all(fmt, path):
    """Every row of path (after the clock stopped: the checksum that says each tool computed the same)."""
    if fmt == "parquet":  # a file, or Dask's folder of part.N.parquet files, in N's order
        from spmd.pipeline.formats.parquet import ParquetSource

        source = ParquetSource(path)
        return source.read(0, source.shape[0])
    if fmt == "npy":
        return np.load(path)
    import zarr

    return np.asarray(zarr.open_array(store=path, mode="r")[:])


def _load(fmt, path, tuned=False):
    """Every row of the input, as a user reads it (tuned: Parquet columns taken as spmd takes them)."""
    if fmt == "parquet":
        import pyarrow.parquet as pq

        table = pq.read_table(path, use_threads=False)
        if not tuned:
            return np.column_stack([table.column(c).to_numpy() for c in table.column_names])
        from spmd.pipeline.formats.parquet import column_into  # no pandas (to_numpy imports it)

        rows = np.empty((table.num_rows, table.num_columns), np.float32)
        for j, c in enumerate(table.column_names):
            column_into(rows[:, j], table.column(c))
        return rows
    if fmt == "npy":
        return np.load(path)
    import zarr

    return np.asarray(zarr.open_array(store=path, mode="r")[:])


def _save(fmt, path, rows, tuned=False):
    """The output, as a user writes it (tuned: Parquet without pandas or dictionaries, 8 MiB row groups)."""
    if fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        if not tuned:
            pq.write_table(pa.table({f"c{j}": rows[:, j] for j in range(rows.shape[1])}), path)
            return
        from spmd.pipeline.formats.parquet_output import ROW_GROUP_BYTES, arrow_column

        table = pa.Table.from_arrays([arrow_column(pa, rows[:, j]) for j in range(rows.shape[1])], names=NAMES)
        pq.write_table(table, path, use_dictionary=False, row_group_size=ROW_GROUP_BYTES // rows[0].nbytes)
        return
    if fmt == "npy":
        np.save(path, rows)
        return
    import zarr

    from spmd.pipeline.formats.zarr_arrays import CHUNK_BYTES

    per = max(1, CHUNK_BYTES // (rows.dtype.itemsize * rows.shape[1]))
    zarr.create_array(store=path, shape=rows.shape, chunks=(per, rows.shape[1]), dtype=rows.dtype)[:] = rows


def serial(fmt, src, out, chunk):
    compute(np.zeros((1, FEATURES), np.float32))
    t0, c0 = time.perf_counter(), time.process_time()
    rows = _load(fmt, src)
    _save(fmt, out, np.concatenate([compute(rows[a : a + chunk]) for a in range(0, rows.shape[0], chunk)]))
    _report(fmt, time.perf_counter() - t0, out, [time.process_time() - c0])


def spmd_run(fmt, src, out, chunk):
    from spmd import comm
    from spmd.pipeline.run import pipeline

    compute(np.zeros((1, FEATURES), np.float32))
    comm.barrier()
    t0, c0 = time.perf_counter(), time.process_time()
    result = pipeline(compute, src if comm.rank == 0 else None, output=out, chunk_rows=chunk)
    seconds, cpu = time.perf_counter() - t0, comm.gather_object(time.process_time() - c0)
    if comm.rank == 0:
        _report(fmt, seconds, out, cpu, read=result.read_mode, write=result.write_mode)


def mpi4py_loop(fmt, src, out, chunk, tuned=False):
    """Root reads the whole input, Scatterv/Gatherv per round, root writes: what a user writes by hand
    (tuned: reading and writing Parquet as spmd does)."""
    from mpi4py import MPI

    from spmd.comms.arrays import split_sizes

    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    compute(np.zeros((1, FEATURES), np.float32))
    world.Barrier()
    t0, c0 = time.perf_counter(), time.process_time()
    rows = _load(fmt, src, tuned) if rank == 0 else None
    n = world.bcast(rows.shape[0] if rank == 0 else None, root=0)
    got = np.empty((n, OUT_WIDTH), np.float32) if rank == 0 else None
    for a in range(0, n, chunk):
        b = min(a + chunk, n)
        counts = np.array(split_sizes(b - a, size))
        part = np.empty((counts[rank], FEATURES), np.float32)
        world.Scatterv([np.ascontiguousarray(rows[a:b]), counts * FEATURES, MPI.FLOAT] if rank == 0 else None,
                       part, root=0)
        res = np.ascontiguousarray(compute(part), np.float32)
        world.Gatherv(res, [got[a:b], counts * OUT_WIDTH, MPI.FLOAT] if rank == 0 else None, root=0)
    if rank == 0:
        _save(fmt, out, got, tuned)
    seconds = time.perf_counter() - t0
    cpu = world.gather(time.process_time() - c0, root=0)  # rank 1's clock stops after its last Gatherv
    if rank == 0:
        _report(fmt, seconds, out, cpu)


def dask_run(fmt, src, out, chunk):
    """Dask with a pool of 2 threads: read_parquet -> map_partitions -> to_parquet; from_zarr -> map_blocks ->
    to_zarr; from_array over np.load's map -> map_blocks -> compute -> np.save."""
    import dask

    # by their module's name, not __main__'s: Dask names its tasks by pickling the functions
    from benchmarks.formats_worker import compute, frame_part

    compute(np.zeros((1, FEATURES), np.float32))
    with dask.config.set(scheduler="threads", num_workers=2):
        t0, c0 = time.perf_counter(), time.process_time()
        if fmt == "parquet":
            import dask.dataframe as dd
            import pandas as pd

            frame = dd.read_parquet(src, split_row_groups=True)  # a partition per row group: its best here
            parts = frame.npartitions
            meta = pd.DataFrame({c: np.empty(0, np.float32) for c in NAMES})
            frame.map_partitions(frame_part, meta=meta).to_parquet(out, write_index=False)
        elif fmt == "npy":  # Dask has no .npy writer of one file: the blocks computed, then np.save
            import dask.array as da

            arr = da.from_array(np.load(src, mmap_mode="r"), chunks=(chunk, FEATURES))
            parts = arr.numblocks[0]
            np.save(out, arr.map_blocks(compute, chunks=(arr.chunks[0], (OUT_WIDTH,)), dtype=np.float32).compute())
        else:
            import dask.array as da

            arr = da.from_zarr(src)
            arr = arr.rechunk((chunk, FEATURES))
            parts = arr.numblocks[0]
            arr.map_blocks(compute, chunks=(arr.chunks[0], (OUT_WIDTH,)), dtype=np.float32).to_zarr(out)
    _report(fmt, time.perf_counter() - t0, out, [time.process_time() - c0], partitions=parts)


def read_only(fmt, src, out, chunk, repeats=5):
    """spmd's Parquet source reading every row into one array, beside pyarrow's read_table (and its 2-D array);
    the wall and the CPU seconds of each."""
    import pyarrow.parquet as pq

    from spmd.pipeline.formats.parquet import ParquetSource

    times = {"spmd": [], "read_table": [], "read_table_2d": [], "spmd_cpu": [], "read_table_cpu": []}
    for _ in range(repeats):
        t, used = time.perf_counter(), time.process_time()
        source = ParquetSource(src)
        a = source.read(0, source.shape[0])
        times["spmd"].append(time.perf_counter() - t)
        times["spmd_cpu"].append(time.process_time() - used)
        t, used = time.perf_counter(), time.process_time()
        table = pq.read_table(src, use_threads=False)  # it still decodes in pyarrow's threads (its CPU seconds)
        times["read_table"].append(time.perf_counter() - t)
        times["read_table_cpu"].append(time.process_time() - used)
        b = np.column_stack([table.column(c).to_numpy() for c in table.column_names])
        times["read_table_2d"].append(time.perf_counter() - t)
        assert np.array_equal(a, b)
        del a, b, table
    print("FORMATS_BENCH " + json.dumps({k: sorted(v)[len(v) // 2] for k, v in times.items()}), flush=True)


IMPLS = {"serial": serial, "spmd": spmd_run, "mpi4py": mpi4py_loop, "dask": dask_run, "read": read_only,
         "mpi4py-tuned": lambda *args: mpi4py_loop(*args, tuned=True)}


def main(argv):
    impl, fmt, src, out, chunk = argv[0], argv[1], argv[2], argv[3], int(argv[4])
    IMPLS[impl](fmt, src, out, chunk)


if __name__ == "__main__":
    main(sys.argv[1:])
