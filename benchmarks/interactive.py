"""The interactive session beside ipyparallel: a statement's round trip, a small all-reduce, a world's start.

    python -m benchmarks.interactive [--ranks 4] [--repeats 20] [--starts 5] [--json FILE] [--no-kernel]

spmd: a Session of RANKS gloo ranks (what ``spmd repl`` and ``%%spmd`` run
on).  ipyparallel: a Cluster of RANKS engines started by mpiexec
(``engines="mpi"``), each with mpi4py's COMM_WORLD, driven by a DirectView
as ``%px`` drives it.  Each case alternates the two, medians of REPEATS:
``x = 1`` on every rank; an all-reduce of 8 float64 on every rank
(``comm.all_reduce`` beside mpi4py's ``Allreduce``); and, STARTS times, the
start of a world: spmd's restart from the host that keeps torch imported,
spmd's whole start, and ipyparallel's cluster start.  Then the same two
statements as cells in Jupyter kernels, ``%%spmd`` beside ``%%px``
(benchmarks.notebook).  Targets: 20 ms, 50 ms, 2 s (the restart); a cell's
the same as its statement's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any, Callable

from spmd.errors import BenchError

__all__ = ["measure", "report", "main", "TARGETS"]

#: Each case's target for spmd's median, in seconds.
TARGETS = {"x = 1": 0.020, "all_reduce of 8 float64": 0.050, "start of a world (restart, torch preloaded)": 2.0,
           "%%spmd cell: x = 1": 0.020, "%%spmd cell: all_reduce of 8 float64": 0.050}

_SPMD_REDUCE = "r = comm.all_reduce(np.ones(8))"
_IPP_SETUP = "from mpi4py import MPI\nimport numpy as np\ncomm = MPI.COMM_WORLD\nb = np.empty(8)"
_IPP_REDUCE = "comm.Allreduce(np.ones(8), b)"


def _timed(fn: Callable[[], Any]) -> float:
    began = time.perf_counter()
    fn()
    return time.perf_counter() - began


def _ipp_cluster(ranks: int) -> tuple[Any, Any, Any]:
    import os

    import ipyparallel as ipp

    bin_dir = os.path.dirname(sys.executable)  # the mpich wheel's mpiexec, for engines="mpi"
    if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")
    cluster = ipp.Cluster(n=ranks, engines="mpi", log_level=40)
    client = cluster.start_and_connect_sync()
    client.wait_for_engines(ranks, timeout=120)
    view = client[:]
    view.block = True
    return cluster, client, view


def measure(ranks: int = 4, repeats: int = 20, starts: int = 5) -> dict[str, dict[str, list[float]]]:
    """Seconds of every run of every case, by tool, interleaved."""
    from spmd.interactive.session import Session

    cases = ("x = 1", "all_reduce of 8 float64", "start of a world (restart, torch preloaded)",
             "start of a whole session")
    times: dict[str, dict[str, list[float]]] = {case: {"spmd": [], "ipyparallel": []} for case in cases}
    session = Session(ranks)
    cluster, client, view = _ipp_cluster(ranks)
    try:
        session.run("import numpy as np")
        view.execute(_IPP_SETUP)
        for _ in range(3):  # warm both
            session.run("x = 1"), view.execute("x = 1")
        for _ in range(repeats):
            times["x = 1"]["spmd"].append(_timed(lambda: session.run("x = 1")))
            times["x = 1"]["ipyparallel"].append(_timed(lambda: view.execute("x = 1")))
            times["all_reduce of 8 float64"]["spmd"].append(_timed(lambda: session.run(_SPMD_REDUCE)))
            times["all_reduce of 8 float64"]["ipyparallel"].append(_timed(lambda: view.execute(_IPP_REDUCE)))
        check = session.pull("r")
        if any(list(r) != [float(ranks)] * 8 for r in check):
            raise BenchError(f"spmd's all_reduce gave {check}")
        if list(view.pull("b")[0]) != [float(ranks)] * 8:
            raise BenchError("mpi4py's Allreduce under ipyparallel gave a wrong sum")
        for _ in range(starts):
            times["start of a world (restart, torch preloaded)"]["spmd"].append(session.restart())
            times["start of a world (restart, torch preloaded)"]["ipyparallel"].append(_restart_ipp(cluster, ranks))
    finally:
        session.stop()
        client.close()
        cluster.stop_cluster_sync()
    for _ in range(starts):
        began = time.perf_counter()
        Session(ranks).stop()
        times["start of a whole session"]["spmd"].append(time.perf_counter() - began)
        began = time.perf_counter()
        c, cl, _ = _ipp_cluster(ranks)
        times["start of a whole session"]["ipyparallel"].append(time.perf_counter() - began)
        cl.close()
        c.stop_cluster_sync()
    return times


def _restart_ipp(cluster: Any, ranks: int) -> float:
    """ipyparallel's restart of its engines (its controller kept), timed until all are back."""
    began = time.perf_counter()
    cluster.restart_engines_sync()
    client = cluster.connect_client_sync()
    client.wait_for_engines(ranks, timeout=120)
    client.close()
    return time.perf_counter() - began


def report(times: dict[str, dict[str, list[float]]], ranks: int) -> str:
    lines = [f"interactive, {ranks} ranks (medians; ipyparallel: {ranks} mpiexec engines)",
             f"{'case':46} {'spmd':>10} {'ipyparallel':>12} {'spmd/ipp':>9} {'target':>8}"]
    for case, by in times.items():
        spmd, ipp = statistics.median(by["spmd"]), statistics.median(by["ipyparallel"])
        target = TARGETS.get(case)
        mark = "" if target is None else f"{_fmt(target):>8} {'met' if spmd <= target else 'MISSED'}"
        lines.append(f"{case:46} {_fmt(spmd):>10} {_fmt(ipp):>12} {spmd / ipp:>8.2f}x {mark}")
    return "\n".join(lines)


def _fmt(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.interactive", description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--starts", type=int, default=5)
    parser.add_argument("--json", metavar="FILE")
    parser.add_argument("--no-kernel", action="store_true",
                        help="leave out the cells in Jupyter kernels (benchmarks.notebook)")
    args = parser.parse_args(argv)
    import importlib.util

    if importlib.util.find_spec("ipyparallel") is None:
        print("python -m benchmarks.interactive: ipyparallel is needed for the comparison: "
              "pip install -r benchmarks/requirements.txt (bin/setup installs it)", file=sys.stderr)
        return 2
    times = measure(args.ranks, args.repeats, args.starts)
    if not args.no_kernel:
        from benchmarks.notebook import measure_cells

        times.update(measure_cells(args.ranks, args.repeats))
    print(report(times, args.ranks))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"ranks": args.ranks, "times": times}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
