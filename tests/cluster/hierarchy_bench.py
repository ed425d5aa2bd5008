"""Bytes out of a host and time per all_reduce, by host (spmd.comms.hierarchy) against flat, on the private cluster.

    .venv/bin/python -m tests.cluster.hierarchy_bench [--rounds 5] [--cap 200] [--backend gloo]

Starts a lab of 2 hosts, launches 2 x 2 ranks (mpiexec -n 4 -ppn 2) uncapped and then with both
hosts' links capped at --cap Mbit/s, and in each launch times, for each size, in interleaved rounds:
spmd's all_reduce of the world (by host, SPMD_HIERARCHY=on), spmd's flat all_reduce (a split of
the whole world: flat, as every sub-communicator is) and the raw library's (torch.distributed's on
gloo, MPI_Allreduce through mpi4py on mpi), reading h1's eth0 tx counter around each.  Prints a
table of medians per size and variant: MB out of h1 per all_reduce, ms per all_reduce.
docs/performance.md, "Hierarchy across hosts".  ``--world`` is the launched side.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

SIZES = {"uncapped": (256 << 10, 1 << 20, 4 << 20, 32 << 20), "capped": (1 << 20, 4 << 20, 32 << 20)}


def world(sizes, rounds):
    """The launched side: every rank times each variant; rank 0 (on h1) prints one RESULT line."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    from spmd import comm

    flat = comm.split(0)
    if comm.backend == "mpi":
        from mpi4py import MPI

        def raw(t):
            MPI.COMM_WORLD.Allreduce(MPI.IN_PLACE, t.numpy(), MPI.SUM)
    else:
        import torch.distributed as dist

        def raw(t):
            dist.all_reduce(t)

    def tx():
        with open("/sys/class/net/eth0/statistics/tx_bytes") as f:
            return int(f.read())

    variants = {"hierarchy": comm.all_reduce, "flat": flat.all_reduce, "raw": raw}
    rows = []
    for size in sizes:
        t = torch.ones(size // 4)
        for fn in variants.values():  # warm: the groups built, the buffers touched
            fn(t)
        got = {name: ([], []) for name in variants}
        for _ in range(rounds):
            for name, fn in variants.items():
                comm.barrier()
                before, start = tx(), time.perf_counter()
                fn(t)
                took = time.perf_counter() - start
                comm.barrier()
                got[name][0].append(tx() - before)
                got[name][1].append(took)
        for name, (sent, took) in got.items():
            slowest = max(comm.all_gather_object(statistics.median(took)))
            rows.append({"size": size, "variant": name, "mb_out_h1": statistics.median(sent) / 1e6,
                         "ms": slowest * 1e3})
    assert comm._hierarchy is not None and comm._hierarchy.hosts.groups == ((0, 1), (2, 3))
    if comm.rank == 0:
        print("RESULT " + json.dumps(rows), flush=True)


def table(title, rows):
    print(f"\n{title}\n{'size':>8} {'variant':>10} {'MB out of h1':>13} {'ms':>9}")
    for r in rows:
        print(f"{r['size'] >> 10:>7}K {r['variant']:>10} {r['mb_out_h1']:>13.1f} {r['ms']:>9.1f}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--cap", type=int, default=200, help="Mbit/s of each host's link in the capped launch")
    parser.add_argument("--backend", default="gloo", choices=("gloo", "mpi"))
    parser.add_argument("--only", choices=tuple(SIZES), help="one launch only")
    parser.add_argument("--world", nargs="*", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.world is not None:
        return world(args.world, args.rounds)
    from tests.cluster.lab import Lab
    from tests.cluster.runs import PY, mpiexec

    lab = Lab.start(hosts=2, dummy=False)
    try:
        for mode in (args.only,) if args.only else tuple(SIZES):
            if mode == "capped":
                for host in ("h1", "h2"):
                    lab.cap(host, args.cap)
            cmd = ["-n", "4", "-ppn", "2", PY, "-m", "tests.cluster.hierarchy_bench", "--rounds", args.rounds,
                   "--world", *SIZES[mode]]
            out = mpiexec(lab, cmd, ["h1", "h2"], timeout=540, SPMD_BACKEND=args.backend, SPMD_HIERARCHY="on")
            line = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
            if out.returncode or not line:
                sys.exit(f"the {mode} launch failed (exit status {out.returncode}):\n{out.stdout[-4000:]}")
            cap = f", links capped at {args.cap} Mbit/s" if mode == "capped" else ""
            table(f"{args.backend}, 2 hosts x 2 ranks{cap}: medians of {args.rounds} interleaved rounds",
                  json.loads(line[0][len("RESULT "):]))
    finally:
        lab.stop()


if __name__ == "__main__":
    main()
