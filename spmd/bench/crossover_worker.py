"""One launch of the crossover measurement: an embedding's gradient as rows, or whole, at touched fractions.

    spmd run -n 2 python -m spmd.bench.crossover_worker '{"vocab": 30522, "width": 256, "repeats": 15}'

For each fraction of the rows touched per rank (each rank its own rows),
times ``RowSender.synchronize`` forced to send rows and forced to send the
matrix (one all_reduce), alternating, median of the repeats; rank 0 prints
``CROSSOVER_BENCH {json}``: per fraction, ms of each and the choice spmd's byte
rule (``spmd.train.sparse_rows.CROSSOVER`` of the backend) makes.
"""

import json
import statistics
import sys
import time

FRACTIONS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.35, 0.5)


def run(o):
    import torch
    from torch import nn

    import spmd
    from spmd import comm
    from spmd.train import sparse_rows

    spmd.init()
    torch.set_num_threads(1)
    table = nn.Parameter(torch.zeros(o["vocab"], o["width"]))
    weight = sparse_rows.RowWeight("tokens.weight", table, False, None)
    sender = sparse_rows.RowSender(comm, [weight], comm.size)
    g = torch.Generator().manual_seed(comm.rank)
    rule = sender.crossover
    out = []
    for fraction in FRACTIONS:
        k = max(1, int(fraction * o["vocab"]))
        picked = torch.randperm(o["vocab"], generator=g)[:k]
        times = {"rows": [], "dense": []}
        sender.crossover = rule
        chosen = sender._goes_dense(weight, k)
        for _ in range(o["repeats"]):
            for way in ("rows", "dense"):
                table.grad = torch.zeros_like(table)
                table.grad[picked] = 1.0
                sender.crossover = float("inf") if way == "rows" else 0.0
                comm.barrier()
                t0 = time.perf_counter()
                sender.synchronize()
                times[way].append(time.perf_counter() - t0)
        sender.crossover = rule
        slowest = {w: comm.all_gather_object(statistics.median(t)) for w, t in times.items()}
        out.append({"fraction": fraction, "rows": k, "rule": "dense" if chosen else "rows",
                    **{f"{w}_ms": max(v) * 1e3 for w, v in slowest.items()}})
    if comm.rank == 0:
        print("CROSSOVER_BENCH " + json.dumps({"ranks": comm.size, "backend": comm.backend, **o, "points": out}),
              flush=True)
    spmd.finalize()


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    run({"vocab": 30522, "width": 256, "repeats": 15, **(json.loads(argv[0]) if argv else {})})


if __name__ == "__main__":
    main()
