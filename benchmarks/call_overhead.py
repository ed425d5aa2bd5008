"""The cost of one call of spmd's hot path, before and after a change, interleaved.

Times ``comm.all_reduce`` on torch CPU tensors of 8 B and 64 KiB, blocking
(the direct path) and async (the general path, then ``wait()``), on the mpi
and gloo backends, under ``mpirun -n 2``: each launch runs one source tree
of spmd on one backend, and the launches rotate between the trees round by
round, so load on this machine falls on both alike.  Reported: per cell, the
median over rounds of each launch's median µs per call (the slower rank's),
and after/before.

    python benchmarks/call_overhead.py BEFORE_TREE AFTER_TREE [--rounds 5]

where each tree is a checkout of spmd (its ``spmd/`` is put first on the
workers' ``PYTHONPATH``).  A worker's own form: ``--worker``, under mpirun.
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


def _worker(calls):
    import torch

    import spmd
    from spmd import comm

    out = {"file": spmd.__file__, "backend": comm.backend}
    for nbytes in SIZES:
        x = torch.ones(nbytes // 4)
        for form in FORMS:
            samples = []
            for _ in range(7):
                comm.barrier()
                start = time.perf_counter()
                if form == "blocking":
                    for _ in range(calls):
                        comm.all_reduce(x)
                else:
                    for _ in range(calls):
                        comm.all_reduce(x, async_op=True).wait()
                took = (time.perf_counter() - start) / calls
                samples.append(max(comm.all_gather_object(took)))  # the slower rank's
            out[f"{form} {nbytes}"] = statistics.median(samples[1:]) * 1e6  # the first warms up
    if comm.rank == 0:
        print("RESULT " + json.dumps(out), flush=True)


def _launch(tree, backend, calls):
    env = dict(os.environ, PYTHONPATH=tree, SPMD_BACKEND=backend, OMP_NUM_THREADS="1")
    mpirun = os.path.join(os.path.dirname(sys.executable), "mpirun")
    cmd = [mpirun, "-n", "2", sys.executable, os.path.abspath(__file__), "--worker", "--calls", str(calls)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            result = json.loads(line[7:])
            if not result["file"].startswith(os.path.abspath(tree)):
                raise SystemExit(f"{tree}: the workers imported {result['file']}")
            return result
    raise SystemExit(f"{tree} {backend}: no result\n{done.stdout}\n{done.stderr}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trees", nargs="*")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--worker", action="store_true")
    args = parser.parse_args()
    if args.worker:
        return _worker(args.calls)
    if len(args.trees) != 2:
        parser.error("give two trees: before and after")
    trees = [os.path.abspath(t) for t in args.trees]
    got = {(t, b): [] for t in trees for b in ("mpi", "gloo")}
    for r in range(args.rounds):
        order = trees if r % 2 == 0 else trees[::-1]
        for backend in ("mpi", "gloo"):
            for tree in order:
                got[tree, backend].append(_launch(tree, backend, args.calls))
                print(f"round {r + 1}: {backend} {tree} done", file=sys.stderr)
    print("| backend | call | size | before µs | after µs | after/before | every round's ratio |")
    print("|---|---|---:|---:|---:|---:|---|")
    for backend in ("mpi", "gloo"):
        for form in FORMS:
            for nbytes in SIZES:
                key = f"{form} {nbytes}"
                before = [run[key] for run in got[trees[0], backend]]
                after = [run[key] for run in got[trees[1], backend]]
                ratios = ", ".join(f"{a / b:.2f}" for a, b in zip(after, before))
                b, a = statistics.median(before), statistics.median(after)
                size = "8 B" if nbytes == 8 else "64 KiB"
                print(f"| {backend} | {form} | {size} | {b:.1f} | {a:.1f} | {a / b:.2f} | {ratios} |")


if __name__ == "__main__":
    main()
