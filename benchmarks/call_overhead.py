"""The cost of one call of spmd's hot path, before and after a change, interleaved.

Times ``comm.all_reduce`` on torch CPU tensors of 8 B and 64 KiB, blocking
(the direct path) and async (the general path, then ``wait()``), on the mpi
and gloo backends.  Each launch runs one source tree of spmd on one backend,
and the launches rotate between the trees round by round, so load on this
machine falls on both alike.  Reported: per cell, the median over rounds of
each launch's median µs per call, and after/before with every round's ratio.

Two ways to measure:

- ``--alone`` (the default): a world of one in one process (mpi on
  COMM_SELF, gloo over a HashStore), timed with the process's CPU clock: the
  Python spmd adds to a call, which other jobs on the machine barely disturb.
- ``--ranks 2``: two ranks under ``mpirun``, timed by the wall clock (the
  slower rank's): the whole call, and all of the machine's noise with it.

    python -m benchmarks.call_overhead BEFORE_TREE AFTER_TREE [--rounds 5] [--ranks 2]

where each tree is a checkout of spmd (its directory is put first on the
workers' ``PYTHONPATH``).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

SIZES = (8, 65536)
FORMS = ("blocking", "async")
BACKENDS = ("mpi", "gloo")


def _world_of_one(backend):
    """A communicator of one rank on backend, built the way the tree in use builds one."""
    try:  # a communicator that holds its backend
        from spmd.comms.comm import Comm
    except ImportError:  # a backend that is the end of the communicator's class chain
        Comm = None
    if backend == "mpi":
        from mpi4py import MPI

        if Comm is not None:
            from spmd.comms.backends.mpi.backend import MpiBackend

            return Comm(MpiBackend(MPI.COMM_SELF))
        from spmd.comms.backends.mpi.comm import MpiComm

        return MpiComm(MPI.COMM_SELF)
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    if Comm is not None:
        from spmd.comms.backends.torchdist.gloo import GlooBackend

        return Comm(GlooBackend("gloo"))
    from spmd.comms.backends.torchdist.gloo import GlooComm

    return GlooComm("gloo", None)


def _worker(backend, calls, alone):
    import torch

    import spmd

    if alone:
        comm, clock, slowest = _world_of_one(backend), time.process_time, (lambda t: t)
    else:
        from spmd import comm

        clock = time.perf_counter

        def slowest(t):
            return max(comm.all_gather_object(t))

    out = {"file": spmd.__file__, "backend": comm.backend}
    for nbytes in SIZES:
        x = torch.ones(nbytes // 4)
        for form in FORMS:
            samples = []
            for _ in range(7):
                if not alone:
                    comm.barrier()
                start = clock()
                if form == "blocking":
                    for _ in range(calls):
                        comm.all_reduce(x)
                else:
                    for _ in range(calls):
                        comm.all_reduce(x, async_op=True).wait()
                samples.append(slowest((clock() - start) / calls))
            out[f"{form} {nbytes}"] = statistics.median(samples[1:]) * 1e6  # the first warms up
    if comm.rank == 0:
        print("RESULT " + json.dumps(out), flush=True)


def _launch(tree, backend, calls, ranks):
    # Run as a script, so the only spmd on the path is the tree's (python -m would put the cwd's first).
    env = dict(os.environ, PYTHONPATH=tree, SPMD_BACKEND=backend, OMP_NUM_THREADS="1")
    me = [sys.executable, os.path.abspath(__file__), "--worker", backend, "--calls", str(calls)]
    if ranks == 1:
        cmd = me + ["--ranks", "1"]
    else:
        mpirun = os.path.join(os.path.dirname(sys.executable), "mpirun")
        cmd = [mpirun, "-n", str(ranks)] + me + ["--ranks", str(ranks)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=tree)
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            result = json.loads(line[7:])
            if not result["file"].startswith(os.path.abspath(tree) + os.sep):
                raise SystemExit(f"{tree}: the workers imported {result['file']}")
            return result
    raise SystemExit(f"{tree} {backend}: no result\n{done.stdout}\n{done.stderr}")


def compare(before, after, rounds, calls, ranks, progress=None):
    """Run both trees, interleaved; return the table's rows (backend, form, size, before, after, ratios)."""
    trees = (before, after)
    got = {(t, b): [] for t in (0, 1) for b in BACKENDS}
    for r in range(rounds):
        order = (0, 1) if r % 2 == 0 else (1, 0)
        for backend in BACKENDS:
            for t in order:
                got[t, backend].append(_launch(trees[t], backend, calls, ranks))
                if progress:
                    progress(f"round {r + 1}: {backend} {trees[t]} done")
    rows = []
    for backend in BACKENDS:
        for form in FORMS:
            for nbytes in SIZES:
                key = f"{form} {nbytes}"
                b = [run[key] for run in got[0, backend]]
                a = [run[key] for run in got[1, backend]]
                rows.append((backend, form, nbytes, statistics.median(b), statistics.median(a),
                             [y / x for x, y in zip(b, a)]))
    return rows


def main():
    parser = argparse.ArgumentParser(prog="python -m benchmarks.call_overhead", description=__doc__.splitlines()[0])
    parser.add_argument("trees", nargs="*")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--ranks", type=int, default=1, help="1: a world of one, CPU clock (default); 2+: mpirun")
    parser.add_argument("--worker", choices=BACKENDS)
    args = parser.parse_args()
    if args.worker:
        return _worker(args.worker, args.calls, args.ranks == 1)
    if len(args.trees) != 2:
        parser.error("give two trees: before and after")
    before, after = (os.path.abspath(t) for t in args.trees)
    rows = compare(before, after, args.rounds, args.calls, args.ranks, lambda s: print(s, file=sys.stderr))
    clock = "CPU µs per call, a world of one" if args.ranks == 1 else f"wall µs per call, {args.ranks} ranks"
    print(f"| backend | call | size | before ({clock}) | after | after/before | every round's ratio |")
    print("|---|---|---:|---:|---:|---:|---|")
    for backend, form, nbytes, b, a, ratios in rows:
        size = "8 B" if nbytes == 8 else "64 KiB"
        every = ", ".join(f"{r:.2f}" for r in ratios)
        print(f"| {backend} | {form} | {size} | {b:.1f} | {a:.1f} | {a / b:.2f} | {every} |")


if __name__ == "__main__":
    main()
