"""One launch of the pipeline benchmark: one implementation of the same work, timed on root.

    mpirun -n N python -m spmd.bench.pipeline_worker IMPL ROWS CHUNK [OPTIONS as JSON]
    python -m spmd.bench.pipeline_worker serial|pool ROWS CHUNK ...     (no launcher; pool: N workers)
    mpirun -n N python -m mpi4py.futures -m spmd.bench.pipeline_worker mpipool ROWS CHUNK ...

IMPL is serial, spmd, mpi4py, pool or mpipool; root prints one line,
``PIPELINE_BENCH {json}`` (seconds, checksum, peak memory, rows per rank).
What each implementation does and what is timed: docs/bench.md.
"""

import json
import os
import sys
import time

import numpy as np

FEATURES, SEED = 16, 0

_fn = None


def _build():
    """The mlp task's fn, made without a communicator (its weights come from the seed alone)."""
    global _fn
    if _fn is None:
        from spmd.pipeline import tasks

        _fn = tasks.get("mlp").make(FEATURES, SEED, None)
    return _fn


def compute(block):
    """fn for the pool implementations (a module-level name pickles)."""
    return _build()(block)


def _table(rows):
    from spmd.pipeline.sources import SyntheticTable

    return SyntheticTable(rows, FEATURES, SEED)


def _rss():
    from spmd.bench.memory import _kib

    return _kib("VmRSS"), _kib("VmHWM")


def _reset_peak():
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def _start_clock():
    import gc

    gc.collect()
    _reset_peak()
    return time.perf_counter(), _rss()[0]


def _report(t0, rss0, crc, rows_per_rank, **extra):
    seconds = time.perf_counter() - t0
    peak = _rss()[1]
    line = {"seconds": seconds, "checksum": f"{crc:08x}", "peak_extra_kib": max(peak - rss0, 0),
            "rows_per_rank": rows_per_rank, **extra}
    print("PIPELINE_BENCH " + json.dumps(line), flush=True)


def _pin():
    """SPMD_BENCH_PIN=1: each rank on core local_rank (the busy-neighbour scenario)."""
    if os.environ.get("SPMD_BENCH_PIN") == "1" and hasattr(os, "sched_setaffinity"):
        rank = int(os.environ.get("PMI_RANK") or os.environ.get("SPMD_RANK") or 0)
        cores = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cores[rank % len(cores)]})


def serial(rows, chunk, options):
    from spmd.pipeline import checksum

    crc_kind = checksum.get()
    table, fn = _table(rows), _build()
    fn(table.read(0, 1))  # warm: torch's first call
    t0, rss0 = _start_clock()
    crc = 0
    for a in range(0, rows, chunk):
        crc = crc_kind.of(fn(table.read(a, min(a + chunk, rows))), crc)
    _report(t0, rss0, crc, [rows])


def spmd_pipeline(rows, chunk, options):
    _pin()
    from spmd import comm
    from spmd.pipeline.run import pipeline

    fn = _build()
    fn(_table(1).read(0, 1))
    source = _table(rows) if comm.rank == 0 else None
    output = options.pop("output", None)
    keep = (lambda start, block: None) if output is None else output
    comm.barrier()
    t0, rss0 = _start_clock()
    result = pipeline(fn, source, output=keep, chunk_rows=chunk, **options)
    if comm.rank == 0:
        _report(t0, rss0, result.checksum, result.rows_per_rank, read=result.read_mode,
                write=result.write_mode, inside_s=result.total_s, busy_per_rank=result.busy_per_rank)


def mpi4py_loop(rows, chunk, options):
    _pin()
    from mpi4py import MPI

    from spmd.pipeline import checksum
    from spmd.comms.arrays import split_sizes

    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    crc_kind = checksum.get()
    table, fn = (_table(rows) if rank == 0 else None), _build()
    fn(_table(1).read(0, 1))
    out_width = 8
    world.Barrier()
    t0, rss0 = _start_clock()
    crc, mine = 0, 0
    for a in range(0, rows, chunk):
        b = min(a + chunk, rows)
        counts = np.array(split_sizes(b - a, size))
        block = table.read(a, b) if rank == 0 else None
        part = np.empty((counts[rank], FEATURES), np.float32)
        world.Scatterv([block, counts * FEATURES, MPI.FLOAT] if rank == 0 else None, part, root=0)
        out = np.ascontiguousarray(fn(part))
        mine += part.shape[0]
        got = np.empty((b - a, out_width), np.float32) if rank == 0 else None
        world.Gatherv(out, [got, counts * out_width, MPI.FLOAT] if rank == 0 else None, root=0)
        if rank == 0:
            crc = crc_kind.of(got, crc)
    per_rank = world.gather(mine, root=0)
    if rank == 0:
        _report(t0, rss0, crc, per_rank)


def _blocks(table, rows, chunk, pieces):
    for a in range(0, rows, chunk):
        b = min(a + chunk, rows)
        for lo, hi in _cuts(a, b, pieces):
            yield table.read(lo, hi)


def _cuts(a, b, pieces):
    from spmd.comms.arrays import split_sizes

    lo = a
    for n in split_sizes(b - a, pieces):
        yield lo, lo + n
        lo += n


def pool(rows, chunk, options):
    import multiprocessing as mp

    from spmd.pipeline import checksum

    workers = int(options.get("workers", 2))
    crc_kind = checksum.get()
    table = _table(rows)
    with mp.get_context("fork").Pool(workers, initializer=_build) as p:
        p.map(compute, [table.read(0, 1)] * workers)  # every worker started and warm
        t0, rss0 = _start_clock()
        crc = 0
        for out in p.imap(compute, _blocks(table, rows, chunk, workers)):
            crc = crc_kind.of(out, crc)
        _report(t0, rss0, crc, [])


def mpipool(rows, chunk, options):
    from mpi4py import MPI
    from mpi4py.futures import MPIPoolExecutor

    from spmd.pipeline import checksum

    crc_kind = checksum.get()
    workers = MPI.COMM_WORLD.Get_size() - 1
    table = _table(rows)
    with MPIPoolExecutor() as ex:
        list(ex.map(compute, [table.read(0, 1)] * max(workers, 1) * 2))  # every worker up and warm
        t0, rss0 = _start_clock()
        crc = 0
        for out in ex.map(compute, _blocks(table, rows, chunk, max(workers, 1))):
            crc = crc_kind.of(out, crc)
        _report(t0, rss0, crc, [], workers=workers)


IMPLS = {"serial": serial, "spmd": spmd_pipeline, "mpi4py": mpi4py_loop, "pool": pool, "mpipool": mpipool}


def main(argv):
    impl, rows, chunk = argv[0], int(argv[1]), int(argv[2])
    options = json.loads(argv[3]) if len(argv) > 3 else {}
    IMPLS[impl](rows, chunk, options)


if __name__ == "__main__":
    main(sys.argv[1:])
