"""One launch of the training benchmark: jobs/train_dp.py's TinyBert under one gradient averager.

    SPMD_BACKEND=gloo|mpi mpirun -n N python -m spmd.bench.train_worker '{"impl": "spmd", ...}'

The options (JSON, every key optional): ``impl`` "spmd" (spmd.data_parallel's
DataParallel on spmd's communicator) or "ddp" (torch's
DistributedDataParallel on torch.distributed's default group, the one
``spmd.init()`` starts on gloo; a world of one gets a group of its own),
``overlap``, ``compress``, ``bucket_mb`` (spmd), ``dim``, ``layers``,
``heads``, ``global_batch``, ``seed``, ``warmup``, ``steps``, ``probe``,
``mode`` ("time" or "loss").

Every step trains on global batch number step of jobs/train_dp.py's data
(rank_batches: each rank its slice), with AdamW; batches are made before
the clock starts.  In "time" mode each step is timed in parts on every
rank with perf_counter (CPU tensors: torch's ops have finished when they
return):

    forward    the model and the loss
    backward   loss.backward(): for DDP this includes waiting for its
               all_reduces (its reducer finishes them at the end of
               backward); for spmd with overlap it includes the hooks that
               pack and send buckets
    sync       dp.synchronize() (spmd only): send what is left, wait, unpack
    optimizer  optimizer.step() and zero_grad()

With ``probe`` (default on), before each step the same batch runs once
more, forward and backward inside ``no_sync()`` (no gradient is averaged,
nothing is sent), then the gradients are dropped and the ranks meet at a
barrier.  That probe's backward is the local backward, and every case's
communication not hidden behind it is ``backward + sync - local
backward``: the same definition for spmd and DDP, which charges the hooks
and any CPU the communication takes from backward.  (The probe changes
nothing the step computes: the gradients are set to None before it.)

"loss" mode runs the steps untimed and reports every step's loss.  Rank 0
prints one line, ``TRAIN_BENCH {json}``: per step and rank, the parts in
seconds and the losses (each the mean of the ranks' losses, which is the
global batch's mean: every sequence has the same number of masked
tokens).
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
