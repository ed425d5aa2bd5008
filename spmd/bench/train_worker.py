"""One launch of the training benchmark: jobs/train_dp.py's TinyBert under one gradient averager.

    SPMD_BACKEND=gloo|mpi mpirun -n N python -m spmd.bench.train_worker '{"impl": "spmd", ...}'

``impl`` "spmd" (DataParallel) or "ddp" (DistributedDataParallel); each step is
timed in parts (forward, backward, sync, optimizer) on every rank, with a
no_sync probe of the same batch for the local backward; "loss" mode reports
every step's loss.  Rank 0 prints one line, ``TRAIN_BENCH {json}``.  The options
and the definitions of each part: docs/bench.md.
"""

import contextlib
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

JOB = Path(__file__).resolve().parents[2] / "jobs" / "train_dp.py"

DEFAULTS = {"impl": "spmd", "overlap": False, "compress": None, "bucket_mb": None, "dim": 256, "layers": 4,
            "heads": 4, "global_batch": 64, "seed": 0, "warmup": 5, "steps": 30, "probe": True, "mode": "time"}

PARTS = ("forward", "backward", "sync", "optimizer", "step", "local_forward", "local_backward")


def load_job(path=JOB):
    """Import jobs/train_dp.py as a module (it is a script, not part of the package)."""
    if not path.exists():
        from spmd.errors import BenchError

        raise BenchError(f"the training benchmark needs {path} (a checkout of the repository)")
    spec = importlib.util.spec_from_file_location("train_dp", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _threads(comm, torch):
    """Share the CPUs between this node's ranks, as jobs/train_dp.py does; return the count."""
    if not os.environ.get("OMP_NUM_THREADS"):
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        torch.set_num_threads(max(1, (cpus or 1) // comm.local_size))
    return torch.get_num_threads()


def _wrap(o, model, comm):
    """Return (the module to call, no_sync context, synchronize or None, describe())."""
    if o["impl"] == "ddp":
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel

        if not dist.is_initialized():  # a world of one: spmd runs serial, DDP still wants a group
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        # The pooler never gets a gradient (as in BERT): DDP must be told to look for such.
        ddp = DistributedDataParallel(model, find_unused_parameters=True)
        return ddp, ddp.no_sync, None, lambda: {"backend": f"torch {dist.get_backend()}", "buckets": None}
    from spmd.train.data_parallel import DataParallel

    dp = DataParallel(model, bucket_mb=o["bucket_mb"], overlap=o["overlap"], compress=o["compress"])
    # Read at the end: with overlap the buckets are rebuilt after the first step.
    return model, dp.no_sync, dp.synchronize, lambda: {
        "backend": comm.backend, "bucket_mb": dp.bucket_mb, "buckets": len(dp.buckets),
        "bucket_params": [len(b.params) for b in dp.buckets]}


def run(o):
    import torch

    import spmd
    from spmd import comm

    spmd.init()
    job = load_job()
    threads = _threads(comm, torch)
    model = job.build_model(o["seed"], o["dim"], o["layers"], o["heads"])
    net, no_sync, synchronize, describe = _wrap(o, model, comm)
    optimizer = job.make_optimizer(model, "adamw")
    total = o["warmup"] + o["steps"]
    batches = [job.rank_batches(o["seed"], s, o["global_batch"], comm.rank, comm.size)[0] for s in range(total)]
    timed = o["mode"] == "time"
    probe = timed and o["probe"]
    now = time.perf_counter
    parts = {k: [] for k in PARTS}
    losses = []
    comm.barrier()
    began = now()
    for micro in batches:
        if probe:
            t0 = now()
            with no_sync():
                loss = job.mlm_loss(net, micro)
                t1 = now()
                loss.backward()
            t2 = now()
            optimizer.zero_grad()
            parts["local_forward"].append(t1 - t0)
            parts["local_backward"].append(t2 - t1)
            del loss
            comm.barrier()  # as after a step's averaging: every rank starts the step together
        t0 = now()
        loss = job.mlm_loss(net, micro)
        t1 = now()
        loss.backward()
        t2 = now()
        t3 = t2
        if synchronize is not None:
            synchronize()
            t3 = now()
        optimizer.step()
        optimizer.zero_grad()
        t4 = now()
        losses.append(loss.item())
        if timed:
            for k, v in zip(("forward", "backward", "sync", "optimizer", "step"),
                            (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t4 - t0)):
                parts[k].append(v)
    wall = now() - began
    mine = {"parts": parts, "losses": losses, "wall": wall}
    everyone = comm.gather_object(mine)
    if comm.rank == 0:
        n = comm.size
        record = {
            "ranks": n, "threads": threads, "params": sum(p.numel() for p in model.parameters()),
            **describe(), "wall_s": max(r["wall"] for r in everyone),
            "losses": [sum(r["losses"][i] for r in everyone) / n for i in range(total)],
            "parts": {k: [r["parts"][k] for r in everyone] for k in PARTS},  # [rank][step]
            "warmup": o["warmup"], "steps": o["steps"],
        }
        print("TRAIN_BENCH " + json.dumps(record), flush=True)
    # DDP's reducer holds the process group, and gloo's threads stop only once
    # nothing holds it: drop it before finalize destroys the group.
    del net, no_sync, synchronize, describe, optimizer, model
    import gc

    gc.collect()
    if o["impl"] == "ddp" and comm.size == 1:
        import torch.distributed as dist

        dist.destroy_process_group()
    spmd.finalize()


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    given = json.loads(argv[0]) if argv else {}
    unknown = sorted(set(given) - set(DEFAULTS))
    if unknown:
        sys.exit(f"train_worker: unknown options {unknown}; known: {sorted(DEFAULTS)}")
    run({**DEFAULTS, **given})


if __name__ == "__main__":
    main()
