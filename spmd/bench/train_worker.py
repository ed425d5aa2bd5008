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

DEFAULTS = {"impl": "spmd", "overlap": False, "compress": None, "powersgd": None, "powersgd_start": 0,
            "ddp_hook": None, "freeze_unused": False, "bucket_mb": None, "dim": 256, "layers": 4,
            "heads": 4, "global_batch": 64, "seed": 0, "warmup": 5, "steps": 30, "probe": True, "mode": "time",
            "vocab": None, "sparse_rows": False, "sparse_embedding": False, "optimizer": "adamw",
            "zipf": 0.0}

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
    """Return (the module to call, no_sync context, synchronize or None, describe(), wire()).

    wire(micro): the bytes of gradients this rank sent in the step just averaged, on micro.
    """
    if o["impl"] == "ddp":
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel

        if not dist.is_initialized():  # a world of one: spmd runs serial, DDP still wants a group
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        # The pooler never gets a gradient (as in BERT): DDP must be told to look for such,
        # unless freeze_unused took it out of training.
        # torch's powerSGD_hook waits on futures inside its callbacks: with two DDP buckets on
        # gloo both of gloo's threads sat in those waits and the step never ended (seen here
        # at dim 256), so that case gets one bucket (an explicit cap sizes the first one too).
        # With find_unused_parameters DDP's all_reduce of its used map raced the hook's collectives
        # on gloo (torch 2.13: "Received data size doesn't match expected size", at every model
        # size tried): that case freezes the pooler instead, which gets no gradient either way.
        if o["powersgd"] and not o["freeze_unused"]:
            _frozen_unused(model)  # was: model.pooler.requires_grad_(False)
        ddp = DistributedDataParallel(model, find_unused_parameters=not (o["powersgd"] or o["freeze_unused"]),
                                      bucket_cap_mb=1024 if o["powersgd"] else None)
        if o["powersgd"]:
            return _ddp_powersgd(ddp, model, o["powersgd"], comm)
        if o["ddp_hook"] is not None:
            _ddp_hook(ddp, o["ddp_hook"])
        return (ddp, ddp.no_sync, None, lambda: {"backend": f"torch {dist.get_backend()}", "buckets": None},
                lambda micro: ddp_wire_bytes(model, comm.size, micro[0].unique().numel()))
    from spmd.train.data_parallel import DataParallel

    dp = DataParallel(model, bucket_mb=o["bucket_mb"], overlap=o["overlap"], compress=o["compress"],
                      sparse_rows=o["sparse_rows"], powersgd_start=o["powersgd_start"])
    # Read at the end: with overlap the buckets are rebuilt after the first step.
    return model, dp.no_sync, dp.synchronize, lambda: {
        "backend": comm.backend, "bucket_mb": dp.bucket_mb, "buckets": len(dp.buckets),
        "bucket_params": [len(b.params) for b in dp.buckets]}, lambda micro: spmd_wire_bytes(dp, comm.size)


def _ddp_hook(ddp, name):
    """Register torch's stateless hook name on ddp: "fp16" (fp16_compress_hook) or "bf16" (bf16_compress_hook)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    hooks = {"fp16": default_hooks.fp16_compress_hook, "bf16": default_hooks.bf16_compress_hook}
    if name not in hooks:
        sys.exit(f"train_worker: ddp_hook must be one of {sorted(hooks)}, got {name!r}")
    ddp.register_comm_hook(None, hooks[name])


def _frozen_unused(model):
    """Take the parameters the loss never reaches (the pooler) out of training; return their count."""
    pooler = getattr(model, "pooler", None)
    frozen = list(pooler.parameters()) if pooler is not None else []
    for p in frozen:
        p.requires_grad_(False)
    return len(frozen)


def _ddp_powersgd(ddp, model, rank, comm):
    """DDP with torch's powerSGD_hook at rank `rank`: error feedback and warm start, from the second step
    (the earliest torch allows), matrices compressed under the same rule as spmd's (R (n + m) < n m),
    in one DDP bucket (see _wrap)."""
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

    state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=rank,
                                        start_powerSGD_iter=2, min_compression_rate=1)
    ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    return (ddp, ddp.no_sync, None, lambda: {"backend": f"torch {dist.get_backend()}", "buckets": None},
            lambda micro: ring(4 * powersgd_elements(model, rank), comm.size))


def powersgd_elements(model, rank):
    """Elements of a PowerSGD step at rank `rank`: the factors of the matrices worth it, the rest whole."""
    from spmd.train.powersgd import compressible

    return sum(rank * (p.shape[0] + p[0].numel()) if compressible(p, rank) else p.numel()
               for p in model.parameters() if p.requires_grad)


def ring(nbytes, size):
    """Bytes one rank sends in a ring all_reduce of nbytes: 2 (n-1)/n of them."""
    return 2 * (size - 1) / size * nbytes


def spmd_wire_bytes(dp, size):
    """Bytes of gradients one rank sent in DataParallel's last step: its buckets (ring) and its rows."""
    buckets = sum(ring((b.wire if b.wire is not None else b.flat).nbytes, size) for b in dp.buckets)
    factors = ring(4 * dp.powersgd.wire_elements, size)  # float32 P's and Q's
    return buckets + factors + dp.wire_bytes_of_rows


def ddp_wire_bytes(model, size, touched):
    """Bytes of gradients one rank sends in a DDP step: dense ones in a ring all_reduce; the touched rows
    of a sparse embedding's (its batch's distinct tokens) go to every other rank, with their indices
    (gloo's sparse all_reduce gathers them)."""
    dense, rows = 0, 0
    sparse = [m.weight for m in model.modules() if getattr(m, "sparse", False) and m.weight.requires_grad]
    for w in sparse:
        rows += (size - 1) * touched * (w.shape[1] * w.element_size() + 8)
    ids = {id(w) for w in sparse}
    for p in model.parameters():
        if p.requires_grad and id(p) not in ids:
            dense += p.nelement() * p.element_size()
    return ring(dense, size) + rows


def run(o):
    import torch

    import spmd
    from spmd import comm

    spmd.init()
    job = load_job()
    threads = _threads(comm, torch)
    vocab = o["vocab"] or job.VOCAB
    model = job.build_model(o["seed"], o["dim"], o["layers"], o["heads"], vocab=vocab, sparse=o["sparse_embedding"])
    if o["freeze_unused"]:
        _frozen_unused(model)
    net, no_sync, synchronize, describe, wire = _wrap(o, model, comm)
    wire_bytes = []
    optimizer = job.make_optimizer(model, o["optimizer"])
    total = o["warmup"] + o["steps"]
    batches = [job.rank_batches(o["seed"], s, o["global_batch"], comm.rank, comm.size, vocab=vocab,
                                   zipf=o["zipf"])[0]
               for s in range(total)]
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
        t4 = now()
        if timed:
            wire_bytes.append(wire(micro))  # (untimed)
        optimizer.zero_grad()
        losses.append(loss.item())
        if timed:
            for k, v in zip(("forward", "backward", "sync", "optimizer", "step"),
                            (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t4 - t0)):
                parts[k].append(v)
    wall = now() - began
    mine = {"parts": parts, "losses": losses, "wall": wall, "wire_bytes": wire_bytes}
    everyone = comm.gather_object(mine)
    if comm.rank == 0:
        n = comm.size
        record = {
            "ranks": n, "threads": threads, "params": sum(p.numel() for p in model.parameters()),
            **describe(), "wall_s": max(r["wall"] for r in everyone),
            # per step after the warm-up, the rank that sent most
            "wire_bytes": [max(r["wire_bytes"][i] for r in everyone) for i in range(len(wire_bytes))],
            "losses": [sum(r["losses"][i] for r in everyone) / n for i in range(total)],
            "parts": {k: [r["parts"][k] for r in everyone] for k in PARTS},  # [rank][step]
            "warmup": o["warmup"], "steps": o["steps"],
        }
        print("TRAIN_BENCH " + json.dumps(record), flush=True)
    # DDP's reducer holds the process group, and gloo's threads stop only once
    # nothing holds it: drop it before finalize destroys the group.
    del net, no_sync, synchronize, describe, wire, optimizer, model
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
