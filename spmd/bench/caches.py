"""What each of a communicator's caches is worth: the calls it serves, timed with it on and off.

    mpirun -n 2 python -m spmd.bench.caches                      # the mpi backend
    SPMD_BACKEND=gloo mpirun -n 2 python -m spmd.bench.caches    # gloo
    python -m spmd.bench.caches --rounds 9 --json caches.json

Each case is one call that a cache of ``spmd.comms.state.caches`` serves.  Per
round, the case is timed with its cache on and with it off, in an order
that alternates between rounds, so load from other processes falls on
both alike; a sample is the slowest rank's time per call over about
``--target`` seconds of back-to-back calls.  Reported: the median of each
state over the rounds, and off/on (above 1: the cache saves time).
"""

import argparse
import json
import statistics
import sys
import time

import numpy as np

from spmd.util.atomic import atomic_write

__all__ = ["measure", "table", "main"]

BIG = 16 << 20  # bytes per rank for the results pool's cases


def _cases(comm, kind):
    """Return [(cache, label, call)] for this communicator, in the kind of array asked for."""
    import torch

    def arr(shape, dtype=np.float32):
        a = np.ones(shape, dtype)
        return a if kind == "numpy" else torch.from_numpy(a)

    n, r = comm.size, comm.rank
    small = arr((2,))
    chunks = [arr((2,)) for _ in range(n)]
    uneven = arr((r + 1, 64))
    big = arr((BIG // 4,))
    big_chunks = arr((n * BIG // 4,)) if r == 0 else None
    grads = [arr((1024,)) for _ in range(200)]
    cases = [
        ("descs", "all_gather 8 B (plain)", lambda: comm.all_gather(small)),
        ("descs", "gather uneven rows of 256 B", lambda: comm.gather(uneven, 0)),
        ("descs", "scatter 8 B chunks (plain)", lambda: comm.scatter(chunks if r == 0 else None, 0)),
        ("results", "all_gather 16 MiB per rank (plain)", lambda: comm.all_gather(big)),
        ("results", "scatter 16 MiB per rank (plain)", lambda: comm.scatter(big_chunks, 0)),
        ("flat", "all_reduce of 200 x 4 KiB", lambda: comm.all_reduce(grads)),
    ]
    if comm.backend == "mpi":
        cases += [
            ("layouts", "all_reduce of 200 x 4 KiB", lambda: comm.all_reduce(grads)),
        ]
        if kind == "torch":
            gathered = arr((2 * n,))
            cases += [("plans", "all_gather 8 B (equal=True, out=)",
                       lambda: comm.all_gather(small, equal=True, out=gathered))]
    return cases


def _time(comm, call, calls):
    comm.barrier()
    start = time.perf_counter()
    for _ in range(calls):
        call()
    return (time.perf_counter() - start) / calls


def _calls_for(comm, call, target):
    """Calls per sample: about target seconds on the slowest rank (agreed by all)."""
    call()
    per = _time(comm, call, 3)
    per = max(comm.all_gather_object(per))
    return max(1, min(10000, int(target / max(per, 1e-7))))


def measure(comm, rounds=7, target=0.05, kinds=("numpy", "torch"), progress=None):
    """Return a row per (kind, case): cache, label, on and off medians (seconds per call), off/on."""
    rows = []
    caches = comm._caches
    for kind in kinds:
        for cache, label, call in _cases(comm, kind):
            calls = _calls_for(comm, call, target)
            samples = {True: [], False: []}
            for i in range(rounds):
                for on in ((True, False) if i % 2 == 0 else (False, True)):
                    caches.switch(cache, on)
                    call()  # warm: the first call after switching on fills the cache
                    samples[on].append(_time(comm, call, calls))
            caches.switch(cache, True)
            slowest = {on: np.max(comm.all_gather_object(s), axis=0).tolist() for on, s in samples.items()}
            on, off = statistics.median(slowest[True]), statistics.median(slowest[False])
            row = {"kind": kind, "cache": cache, "case": label, "on_us": on * 1e6, "off_us": off * 1e6,
                   "off_over_on": off / on, "calls": calls, "rounds": rounds}
            rows.append(row)
            if progress:
                progress(row)
    return rows


def table(rows, backend, size):
    lines = [f"caches on {backend}, {size} ranks: median us per call over the rounds (slowest rank)",
             "", "| cache | case | kind | on | off | off/on |", "|---|---|---|---:|---:|---:|"]
    for w in rows:
        lines.append(f"| {w['cache']} | {w['case']} | {w['kind']} | {w['on_us']:.1f} | {w['off_us']:.1f} | "
                     f"{w['off_over_on']:.2f}x |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m spmd.bench.caches", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--target", type=float, default=0.05, help="seconds per sample")
    parser.add_argument("--kinds", default="numpy,torch")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    from spmd import comm

    say = (lambda row: print(f"  {row['cache']:8} {row['case']:38} {row['kind']:6} "
                             f"on {row['on_us']:9.1f} us  off {row['off_us']:9.1f} us  "
                             f"{row['off_over_on']:.2f}x", file=sys.stderr)) if comm.rank == 0 else None
    rows = measure(comm, args.rounds, args.target, tuple(args.kinds.split(",")), say)
    if comm.rank == 0:
        print(table(rows, comm.backend, comm.size))
        if args.json:
            with atomic_write(args.json, text=True) as f:
                json.dump({"backend": comm.backend, "size": comm.size, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
