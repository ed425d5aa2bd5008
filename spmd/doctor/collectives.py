"""One of every collective at a small size, through spmd's own init and comm, each result checked.

Run only once the pair check found nothing that would stop a job: it starts spmd as a job would
(the launcher's backend, the rendezvous, the hub), so a failure here is one a job would meet.
Each rank times and checks its own part; rank 0 gets every rank's (``run_each``).
"""

from __future__ import annotations

import time
from typing import Any, Callable

from spmd.errors import SpmdError

__all__ = ["run_each", "combine", "NAMES", "COVERS", "covered"]

N = 8  # float32s in each collective

#: The checks, in the order they run: each public collective of Comm by its method's name, then a ring
#: of sendrecv.  ``COVERS`` names the methods of a check that calls more than its name says.
NAMES = ("barrier", "broadcast", "all_reduce", "reduce", "all_gather", "gather", "scatter", "reduce_scatter",
         "all_to_all", "scan", "exscan", "broadcast_object", "gather_object", "all_gather_object",
         "scatter_object", "split", "sendrecv ring")
COVERS = {"split": ("split", "free"), "sendrecv ring": ("sendrecv",)}


def covered() -> set[str]:
    """The names of the Comm methods the checks call."""
    return {method for name in NAMES for method in COVERS.get(name, (name,))}


def _cases(comm: Any, np: Any) -> list[tuple[str, Callable[[], bool]]]:
    """(name, a call that runs one collective and says whether its result is right) for each of NAMES."""
    size, rank = comm.size, comm.rank
    mine = lambda: np.full(N, rank + 1, np.float32)  # noqa: E731
    total = size * (size + 1) / 2
    ones = [r + 1.0 for r in range(size)]

    def reduce():
        x = mine()
        comm.reduce(x, root=0)
        return rank != 0 or bool((x == total).all())

    def gather():
        got = comm.gather(mine(), root=0)
        return rank != 0 or [float(g[0]) for g in got] == ones

    def scatter():
        chunks = [np.full(N, r, np.float32) for r in range(size)] if rank == 0 else None
        return bool((comm.scatter(chunks, root=0) == rank).all())

    def scan():  # ranks 0..rank of 1..size: (rank + 1)(rank + 2) / 2
        return bool((comm.scan(mine()) == (rank + 1) * (rank + 2) / 2).all())

    def exscan():  # ranks 0..rank - 1: rank (rank + 1) / 2, and 0 (sum's identity) on rank 0
        return bool((comm.exscan(mine()) == rank * (rank + 1) / 2).all())

    def gather_object():
        got = comm.gather_object(("rank", rank), 0)
        return rank != 0 or got == [("rank", r) for r in range(size)]

    def scatter_object():
        return comm.scatter_object([{"to": r} for r in range(size)] if rank == 0 else None, 0) == {"to": rank}

    def split():  # two halves by parity, each summing its own ranks, then freed
        part = comm.split(rank % 2)
        try:
            return bool((part.all_reduce(mine()) == sum(r + 1 for r in range(rank % 2, size, 2))).all())
        finally:
            part.free()

    def ring():
        if size == 1:
            return True
        got = comm.sendrecv(mine(), dst=(rank + 1) % size, src=(rank - 1) % size)
        return float(got[0]) == (rank - 1) % size + 1

    cases = [
        ("barrier", lambda: comm.barrier() is None or True),
        ("broadcast", lambda: bool((comm.broadcast(mine(), root=0) == 1).all())),
        ("all_reduce", lambda: bool((comm.all_reduce(mine()) == total).all())),
        ("reduce", reduce),
        ("all_gather", lambda: [float(g[0]) for g in comm.all_gather(mine())] == ones),
        ("gather", gather),
        ("scatter", scatter),
        ("reduce_scatter", lambda: bool((comm.reduce_scatter(np.full(size * N, rank + 1, np.float32)) == total).all())),
        ("all_to_all", lambda: [float(c[0]) for c in comm.all_to_all([np.full(N, rank, np.float32)] * size)]
         == [float(r) for r in range(size)]),
        ("scan", scan),
        ("exscan", exscan),
        ("broadcast_object", lambda: comm.broadcast_object({"from": rank}, 0) == {"from": 0}),
        ("gather_object", gather_object),
        ("all_gather_object", lambda: comm.all_gather_object(rank) == list(range(size))),
        ("scatter_object", scatter_object),
        ("split", split),
        ("sendrecv ring", ring),
    ]
    return cases


def run_each(seconds: float) -> tuple[Any, list[dict[str, Any]] | None]:
    """Start spmd (init bounded by seconds) and run each collective once; return (the comm, or None when
    init failed, and on rank 0 every rank's results, None elsewhere)."""
    import numpy as np

    from spmd.runtime.start import init

    try:
        comm = init(timeout=seconds)
    except SpmdError as exc:
        return None, [{"name": "init", "ok": False, "error": str(exc).splitlines()[0], "ms": None, "backend": None}]
    mine = []
    for name, case in _cases(comm, np):
        started = time.perf_counter()
        try:
            ok, error = bool(case()), None
            error = None if ok else "a wrong result"
        except SpmdError as exc:
            ok, error = False, str(exc).splitlines()[0]
        mine.append({"name": name, "ok": ok, "error": error, "ms": 1000 * (time.perf_counter() - started),
                     "backend": comm.backend})
    return comm, comm.gather_object(mine, 0)


def combine(per_rank: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Each collective once: ok when every rank's was, its slowest rank's time, the ranks where it failed
    and the first of their errors."""
    out = []
    for i, first in enumerate(per_rank[0]):
        runs = [(r, results[i]) for r, results in enumerate(per_rank) if i < len(results)]
        bad = [(r, c) for r, c in runs if not c["ok"]]
        out.append({"name": first["name"], "ok": not bad, "backend": first["backend"],
                    "ms": max(c["ms"] for _, c in runs if c["ms"] is not None) if first["ms"] is not None else None,
                    "error": bad[0][1]["error"] if bad else None, "ranks": [r for r, _ in bad]})
    return out
